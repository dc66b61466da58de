"""Datasets in and out (issue #35): ``specbatch run`` on Parquet, CSV, a Hugging Face dataset
folder and JSONL records, through a real worker on SQLite and PostgreSQL. The output is the
input's table with its columns and types kept, plus the results; bad rows are error rows; a
SIGKILLed run resumes to every row exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from tests.worker.test_integration import start_worker

ROOT = Path(__file__).resolve().parents[2]
#: Completions of a random model hold newlines (quoted in the CSV): read them as any CSV reader must.
CSV_PARSE = pacsv.ParseOptions(newlines_in_values=True)
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(module_db_url, module_redis_url, tmp_path_factory):
    """One worker for the module's runs (per database): each test runs the CLI against it."""
    from tests.helpers.tiny_models import make_tiny_model
    from worker.api.client import Client
    from worker.common.config import Settings
    from worker.store.store import Store

    root = tmp_path_factory.mktemp("tables")
    model = str(make_tiny_model(root / "tiny", logit_scale=8.0))
    queue = f"gen.test-{uuid.uuid4().hex[:10]}"
    Store(module_db_url, auto_upgrade=True)  # PostgreSQL is migrated as a deploy step would
    client = Client(broker_url=module_redis_url, database_url=module_db_url, model=model, queue=queue)
    settings = Settings(broker_url=module_redis_url, database_url=module_db_url, model=model, device="cpu",
                        queue=queue)
    worker = start_worker(client, settings, root, seqs=16)
    yield {"model": model, "queue": queue, "redis": module_redis_url, "db": module_db_url, "client": client}
    worker.stop()


def command(served, src: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "worker.api.cli", "--broker-url", served["redis"], "--database-url", served["db"],
            "run", str(src), "--model", served["model"], "--no-local-worker", "--timeout", "200", *flags]


def env_for(served, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=served["queue"], **extra)
    env.pop("DATABASE_URL", None)
    return env


def run(served, src: Path, *flags: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command(served, src, *flags), env=env_for(served), cwd=cwd, capture_output=True,
                          text=True, timeout=240)


def test_parquet_round_trip_with_a_template_over_three_columns_and_bad_rows(served, tmp_path):
    src = tmp_path / "questions.parquet"
    table = pa.table({
        "id": pa.array([101, 102, 103, 104, 105, 106], pa.int64()),
        "topic": ["maths", "poetry", "cooking", "maths", None, "art"],
        "level": pa.array([1, 2, 3, 4, 5, 0], pa.int32()),
        "question": ["what is 2+2?", "a rhyme for moon?", "how long to boil an egg?", "is 7 prime?", "why?", "who?"],
        "score": pa.array([0.5, 1.25, None, 3.0, 4.5, 2.0], pa.float64()),
        "tags": pa.array([["a"], [], ["b", "c"], None, ["d"], ["e"]], pa.list_(pa.string())),
        "max_tokens": pa.array([6, 4, -2, None, 5, 5], pa.int64()),
    })
    pq.write_table(table, src)
    template = "{{ topic | upper }} (level {{ level }}, {{ 10 // level }} tries): {{ question }}"
    res = run(served, src, "--template", template, "--id-column", "id", "--max-tokens", "8", cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]  # some rows failed: said on the terminal
    out = pq.read_table(tmp_path / "questions.out.parquet")
    for name in table.column_names:  # the input's columns, types and values kept
        assert out.schema.field(name).type == table.schema.field(name).type, name
        assert out.column(name).to_pylist() == table.column(name).to_pylist(), name
    rows = out.to_pylist()
    errors = {r["id"]: r["error"] for r in rows}
    assert errors[103].startswith("row 3: max_tokens must be at least 1, got -2"), errors  # negative max_tokens
    assert errors[105] == "row 5: template: 'topic' is undefined (a column null or missing in this row)", errors
    assert errors[106].startswith("row 6: template: ZeroDivisionError"), errors  # the template's own error
    for r in rows:
        if r["id"] in (101, 102, 104):
            assert r["error"] is None and r["completion"] is not None and r["finish_reason"] in ("stop", "length")
            assert r["prompt_tokens"] > 0 and isinstance(r["seed"], int) and r["ttft_s"] is not None
        else:
            assert r["completion"] is None and r["completion_tokens"] is None
    assert rows[0]["completion_tokens"] <= 6 and rows[3]["completion_tokens"] <= 8  # a row's own max_tokens wins
    jobs = {j.custom_id: j for j in served["client"].store.iter_jobs(batch_of(res))}
    assert jobs["101"].messages == [{"role": "user", "content": "MATHS (level 1, 10 tries): what is 2+2?"}]
    assert "3 row(s) failed" in " ".join(res.stderr.split()), res.stderr[-2000:]

    again = run(served, src, "--template", template, "--id-column", "id", "--max-tokens", "8", cwd=tmp_path)
    assert again.returncode == 1
    assert "already succeeded 3" in " ".join(again.stderr.split())  # nothing generated twice
    assert pq.read_table(tmp_path / "questions.out.parquet").equals(out)



def batch_of(res: subprocess.CompletedProcess) -> str:
    """The batch id a run printed."""
    found = re.search(r"batch ([0-9a-f]{32})", res.stderr)
    assert found, res.stderr[-2000:]
    return found.group(1)


def test_csv_keeps_its_text_exactly_and_tsv_is_read_by_its_extension(served, tmp_path):
    src = tmp_path / "people.csv"
    src.write_text('code,name,note\n007,"Bond, James","says ""hi""\nthen leaves"\n0.50,Ada,\n', encoding="utf-8")
    res = run(served, src, "--template", "Greet {{ name }} ({{ code }})", "--max-tokens", "4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = pacsv.read_csv(tmp_path / "people.out.csv", parse_options=CSV_PARSE,
                         convert_options=pacsv.ConvertOptions(strings_can_be_null=True,
                                                              column_types={"code": pa.string()}))
    rows = out.to_pylist()
    assert [r["code"] for r in rows] == ["007", "0.50"]  # CSV cells are text: leading zeros and formats kept
    assert rows[0]["name"] == "Bond, James" and rows[0]["note"] == 'says "hi"\nthen leaves'
    assert all(r["error"] is None and r["finish_reason"] in ("stop", "length") for r in rows), rows
    # Sampled (no --temperature): a completion may be empty (EOS first), an empty cell that reads back as null.
    assert all(r["completion"] is not None or r["finish_reason"] == "stop" for r in rows), rows

    tsv = tmp_path / "people.tsv"
    tsv.write_text("name\tq\nAda\tx\n", encoding="utf-8")
    res = run(served, tsv, "--prompt-column", "q", "--max-tokens", "3", "-o", str(tmp_path / "o.jsonl"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert line["name"] == "Ada" and line["q"] == "x" and line["completion"] is not None  # out by extension


def test_a_datasets_folder_round_trips_with_its_features(served, tmp_path):
    import datasets  # in the test extra: a missing package is a failure, never a skip
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"]),
                                  "weight": datasets.Value("float32")})
    ds = datasets.Dataset.from_dict({"text": ["good film", "bad film", "fine"], "label": [1, 0, 1],
                                     "weight": [0.5, 1.0, 2.0]}, features=features)
    src = tmp_path / "reviews"
    ds.save_to_disk(str(src))
    res = run(served, src, "--template", "Review: {{ text }}", "--max-tokens", "4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = datasets.load_from_disk(str(tmp_path / "reviews.out"))
    assert out.features["label"] == features["label"] and out.features["weight"] == features["weight"]
    assert out["text"] == ds["text"] and out["label"] == ds["label"]
    assert all(c is not None for c in out["completion"]) and out["error"] == [None, None, None]


def test_jsonl_records_with_a_missing_column_and_n_samples(served, tmp_path):
    """JSONL records (not Batch requests) with --n 3: three samples per row, each with its own
    seed, which reruns that sample alone; a record lacking a column is its error row."""
    src = tmp_path / "records.jsonl"
    records = [{"q": "first", "k": 1}, {"k": 2}, {"q": "third", "k": 3, "seed": 42}]
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    res = run(served, src, "--template", "{{ q }}", "--n", "3", "--temperature", "1.0", "--max-tokens", "6",
              cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "records.out.jsonl").read_text().splitlines()]
    assert [r["k"] for r in rows] == [1, 2, 3]
    assert rows[1]["error"] == "row 2: template: 'q' is undefined (a column null or missing in this row)"
    assert rows[1]["completion_0"] is None
    for r in (rows[0], rows[2]):
        seeds = [r[f"seed_{i}"] for i in range(3)]
        assert len(set(seeds)) == 3 and all(isinstance(s, int) for s in seeds)
        assert all(r[f"completion_{i}"] is not None for i in range(3))
    assert rows[2]["seed_0"] == 42  # the row's own seed column; sample 0 keeps it

    from engine import LLM, SamplingParams

    llm = LLM(served["model"], device="cpu", max_model_len=256)
    for i in range(3):  # each sample's seed reruns it alone, exactly
        alone = llm.chat([{"role": "user", "content": "third"}],
                         SamplingParams(seed=rows[2][f"seed_{i}"], temperature=1.0, max_tokens=6), use_tqdm=False)[0]
        assert alone.outputs[0].text == rows[2][f"completion_{i}"], i


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["verdict", "flags", "note"],
          "properties": {
              "verdict": {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
                          "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}}},
              "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
              "note": {"enum": ["ok", "unsure"]}}}


def test_json_schema_fields_become_typed_parquet_columns(served, tmp_path):
    src = tmp_path / "claims.parquet"
    pq.write_table(pa.table({"claim": [f"claim number {i}" for i in range(6)]}), src)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    for fmt in ("parquet", "csv"):
        out = tmp_path / f"claims.out.{fmt}"
        res = run(served, src, "--prompt-column", "claim", "--json-schema", str(schema), "--max-tokens", "150",
                  "--temperature", "0", "-o", str(out), cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    table = pq.read_table(tmp_path / "claims.out.parquet")
    assert table.schema.field("verdict").type == pa.struct([("answer", pa.string()), ("sure", pa.bool_())])
    assert table.schema.field("flags").type == pa.list_(pa.bool_())
    assert table.schema.field("note").type == pa.string()
    for row in table.to_pylist():
        record = json.loads(row["completion"])  # the columns are the answer's own fields
        assert row["verdict"] == record["verdict"] and row["flags"] == record["flags"] and row["note"] == record["note"]
        assert row["verdict"]["answer"] in ("yes", "no") and 1 <= len(row["flags"]) <= 3
    csv_rows = pacsv.read_csv(tmp_path / "claims.out.csv", parse_options=CSV_PARSE).to_pylist()  # nested fields as JSON text in a CSV
    assert [json.loads(r["verdict"]) for r in csv_rows] == table.column("verdict").to_pylist()
    assert [json.loads(r["flags"]) for r in csv_rows] == table.column("flags").to_pylist()


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_sigkilled_run_resumes_to_every_row_exactly_once(served, tmp_path, fmt):
    n = 300
    src = tmp_path / f"many.{fmt}"
    # Questions of their own: greedy answers the other format's run computed would be answered
    # from the result cache, and the run would end before the kill.
    table = pa.table({"key": [f"k{i:04d}" for i in range(n)], "q": [f"question {i} in {fmt}" for i in range(n)]})
    if fmt == "parquet":
        pq.write_table(table, src, row_group_size=64)
    else:
        pacsv.write_csv(table, src)
    out = tmp_path / f"many.out.{fmt}"
    # At most 16 rows in flight: the run lasts several pacer ticks, so the kill lands mid-run.
    flags = ("--prompt-column", "q", "--id-column", "key", "--max-tokens", "16", "--temperature", "0",
             "--max-in-flight", "16")
    env = env_for(served, SPECBATCH_TABLE_FLUSH_ROWS="25", SPECBATCH_TABLE_FLUSH_SECONDS="0.2")
    proc = subprocess.Popen(command(served, src, *flags), env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    progress = tmp_path / f"{out.name}.progress"  # a CSV's rows written so far (whole row groups)
    written = lambda: (len(list((tmp_path / f"{out.name}.parts").glob("part-*.parquet"))) if fmt == "parquet"
                       else (json.loads(progress.read_text() or "{}").get("rows", 0) // 25 if progress.exists() else 0))
    deadline = time.monotonic() + 180
    while written() < 2 and proc.poll() is None:  # at least two row groups out, the run still going
        assert time.monotonic() < deadline, "no row group written"
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if fmt == "parquet":  # what the killed run wrote is readable as it is
        partial = pq.read_table(tmp_path / f"{out.name}.parts")
    else:
        partial = pacsv.read_csv(out, parse_options=CSV_PARSE)
    assert 0 < partial.num_rows < n and partial.column("key").to_pylist() == table.column("key").to_pylist()[:partial.num_rows]

    res = subprocess.run(command(served, src, *flags), env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    final = pq.read_table(out) if fmt == "parquet" else pacsv.read_csv(out, parse_options=CSV_PARSE)
    assert final.column("key").to_pylist() == table.column("key").to_pylist()  # every row once, in order
    assert final.column("error").null_count == n and final.column("completion").null_count == 0
    assert not (tmp_path / f"{out.name}.parts").exists() and not (tmp_path / f"{out.name}.progress").exists()
    jobs = list(served["client"].store.iter_jobs(batch_of(res)))
    assert sorted(j.custom_id for j in jobs) == table.column("key").to_pylist()  # one job per row, never two


@pytest.mark.parametrize("flags, message", [
    (["--prompt-column", "nope"], "column 'nope' is not in the table (its columns: id, q)"),
    (["--template", "{{ q "], "--template: unexpected end of template"),
    (["--template", "{{ q }}", "--keep", "id,zz"], "--keep: column 'zz' is not in the table"),
    ([], "name the prompt with --prompt-column COL or --template (its columns: id, q)"),
    (["--template", "{{ q }}", "-o", "out.xlsx"], "no output format for the extension '.xlsx'"),
])
def test_a_table_run_that_can_never_work_fails_before_anything_starts(tmp_path, flags, message):
    from click.testing import CliRunner

    from worker.api.cli import cli

    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [1], "q": ["x"]}), src)
    res = CliRunner().invoke(cli, ["--broker-url", "redis://127.0.0.1:1/0", "--database-url",
                                   f"sqlite:///{tmp_path / 'sb.db'}", "run", str(src), *flags])
    assert res.exit_code == 2, res.output  # a usage error, before any broker or store is reached
    assert message in " ".join(res.output.split()), res.output


def test_table_flags_on_a_batch_file_are_refused(tmp_path):
    from click.testing import CliRunner

    from worker.api.cli import cli

    src = tmp_path / "batch.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}}) + "\n")
    res = CliRunner().invoke(cli, ["--broker-url", "redis://127.0.0.1:1/0", "run", str(src), "--n", "3"])
    assert res.exit_code == 2 and "--n: for a table's rows; batch.jsonl is read as OpenAI Batch lines" in \
        " ".join(res.output.split()), res.output
