"""Bulk once benchmark, one run: a bulk file that repeats itself, through ``specbatch run``.

The file: ``--systems`` system prompts x ``--questions`` questions (greedy), shuffled, plus
``--dup`` of its rows again as exact duplicates (new custom_ids) at random places: what a
dataset behind a few system prompts with repeated rows looks like. Two sides, alternated per
round, each a fresh SQLite store, the embedded Redis and the local worker ``specbatch run``
starts (SmolLM2, the CPU):

- ``fifo``: what the engine did before: rows published in line order, the engine's waiting
  queue first come first served, no result cache, duplicates computed again
  (``SPECBATCH_PREFIX_ORDER=0 SPECBATCH_CACHE=0 SPECBATCH_ENGINE_KWARGS='{"admission": "fifo"}'``);
- ``once``: the defaults: prefix-ordered publishing, longest-cached-prefix admission with aging,
  duplicates run once, the result cache.

Printed per side: useful tok/s (every row's output tokens, duplicates included, over the window
from the first job started to the last finished), the prefix-cache hit rate of the computed
jobs, jobs computed; the ratio once/fifo per round and its median. Then the same file is run a
second time on the ``once`` side's store: every row answered from the cache, no worker started,
the output file compared with the first run's apart from timings and ids, and its wall time
against ingesting the file alone (``--detach`` into a fresh store, a bench-owned Redis).

    python -m bench.bulk_once [--systems 16] [--questions 48] [--dup 0.1] [--max-tokens 32]
                              [--system-words 300] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ingest import RedisServer  # noqa: E402

FIFO_ENV = {"SPECBATCH_PREFIX_ORDER": "0", "SPECBATCH_CACHE": "0", "SPECBATCH_ENGINE_KWARGS": '{"admission": "fifo"}'}
DOMAINS = ["astronomy", "cooking", "law", "chess", "gardening", "music theory", "sailing", "tax", "poetry",
           "first aid", "geology", "knitting", "economics", "birdwatching", "typography", "beekeeping"]
GOAL_RATIO = 1.5


def system_prompt(k: int, words: int) -> str:
    """A long system prompt of its own per domain (rules a dataset's prompt would carry)."""
    domain = DOMAINS[k % len(DOMAINS)]
    rules = [f"Rule {i}: when asked about {domain}, answer plainly, cite no sources, and keep to the point {i}."
             for i in range(1, 1 + words // 18)]
    return f"You are an expert in {domain} (persona {k}). " + " ".join(rules)


def write_file(path: Path, systems: int, questions: int, dup: float, max_tokens: int, words: int,
               seed: int = 0) -> int:
    rng = random.Random(seed)
    rows = [{"custom_id": f"s{k}-q{q}",
             "body": {"messages": [{"role": "system", "content": system_prompt(k, words)},
                                   {"role": "user", "content": f"Question {q}: in one sentence, what matters most "
                                                               f"about topic number {q}?"}],
                      "max_tokens": max_tokens, "temperature": 0},
             "method": "POST", "url": "/v1/chat/completions"}
            for k in range(systems) for q in range(questions)]
    rng.shuffle(rows)
    for i, row in enumerate(rng.sample(rows, int(len(rows) * dup))):
        rows.insert(rng.randrange(len(rows) + 1), dict(row, custom_id=f"dup-{i}-{row['custom_id']}"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def run(src: Path, out: Path, db_url: str, extra_env: dict[str, str], log: Path, *args: str,
        broker: str | None = None) -> tuple[float, str]:
    """``specbatch run FILE -o OUT ARGS`` with its own store: (wall seconds, what it printed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_DATABASE_URL=db_url, COLUMNS="200", **extra_env)
    env.pop("REDIS_URL", None)
    env.pop("SPECBATCH_BROKER_URL", None)
    t0 = time.perf_counter()
    pre = ["--broker-url", broker] if broker else []
    res = subprocess.run([sys.executable, "-m", "worker.api.cli", *pre, "run", str(src), "-o", str(out), *args],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    log.write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"specbatch run exited {res.returncode}:\n{(res.stdout + res.stderr)[-3000:]}")
    return wall, res.stdout + res.stderr


def figures(db_url: str) -> dict:
    """Useful tok/s, the prefix-cache hit rate of computed jobs, and counts, from the store."""
    from worker.store.models import Job
    from worker.store.store import Store

    store = Store(db_url)
    with store.reader.connect() as conn:
        from sqlalchemy import select

        rows = conn.execute(select(Job.status, Job.started_at, Job.finished_at, Job.num_output_tokens,
                                   Job.num_prompt_tokens, Job.num_cached_tokens, Job.cached, Job.duplicate_of,
                                   Job.attempts)).all()
    store.dispose()
    assert all(r.status == "succeeded" for r in rows), {r.status for r in rows}
    computed = [r for r in rows if not r.cached and r.duplicate_of is None]
    window = max(r.finished_at for r in rows) - min(r.started_at for r in computed)
    tokens = sum(r.num_output_tokens for r in rows)
    prompt = sum(r.num_prompt_tokens for r in computed)
    return {"rows": len(rows), "computed": len(computed), "tokens": tokens, "window_s": window,
            "useful_tok_s": tokens / window, "prefix_hit_rate": sum(r.num_cached_tokens or 0 for r in computed) / prompt,
            "claims": sum(r.attempts for r in rows)}


def normalized(path: Path) -> list[dict]:
    """Output lines without what differs by run: ids, creation times, the timings block and the
    prompt tokens the prefix cache happened to hold (``usage.prompt_tokens_details``)."""
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        row.pop("id", None)
        row.pop("specbatch", None)
        response = row.get("response") or {}
        response.pop("request_id", None)
        body = response.get("body") or {}
        body.pop("id", None)
        body.pop("created", None)
        (body.get("usage") or {}).pop("prompt_tokens_details", None)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", type=int, default=16)
    ap.add_argument("--questions", type=int, default=48)
    ap.add_argument("--dup", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    from bench.machine import describe_machine

    tmp = Path(tempfile.mkdtemp(prefix="bulk-once-"))
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    say(describe_machine())
    src = tmp / "questions.jsonl"
    n = write_file(src, args.systems, args.questions, args.dup, args.max_tokens, args.system_words)
    say(f"input: {n} lines ({args.systems} system prompts of ~{args.system_words} words x {args.questions} questions, "
        f"shuffled, {args.dup:.0%} exact duplicates), greedy, max_tokens {args.max_tokens}; SmolLM2-135M on the CPU")
    ratios, once_db, once_out = [], None, None
    for r in range(args.rounds):
        got = {}
        for side in (("fifo", "once") if r % 2 == 0 else ("once", "fifo")):
            db = f"sqlite:///{tmp / f'{side}-{r}.db'}"
            out = tmp / f"{side}-{r}.out.jsonl"
            wall, _text = run(src, out, db, FIFO_ENV if side == "fifo" else {}, tmp / f"{side}-{r}.log")
            f = got[side] = figures(db)
            say(f"round {r + 1} {side:>4}: {f['useful_tok_s']:7.1f} useful tok/s ({f['tokens']} tokens in "
                f"{f['window_s']:.1f} s; command {wall:.1f} s), prefix-cache hit rate {f['prefix_hit_rate']:.1%}, "
                f"{f['computed']} of {f['rows']} rows computed ({f['claims']} claims)")
            if side == "once":
                once_db, once_out = db, out
            else:
                fifo_out = out
        ratio = got["once"]["useful_tok_s"] / got["fifo"]["useful_tok_s"]
        ratios.append(ratio)
        same = normalized(fifo_out) == normalized(once_out)
        say(f"round {r + 1}: once/fifo {ratio:.2f}x; the two output files {'agree' if same else 'DIFFER'} apart from "
            "timings and ids")
    median = statistics.median(ratios)
    say(f"useful tok/s once/fifo: median {median:.2f}x over {len(ratios)} round(s) "
        f"({', '.join(f'{x:.2f}' for x in ratios)}); goal >= {GOAL_RATIO}x: {'met' if median >= GOAL_RATIO else 'NOT met'}")

    # The same file again on the once side's store, as a batch of its own (under the same name it
    # would resume the first batch, whose rows have all succeeded): the cache answers every row.
    again = tmp / "again.out.jsonl"
    wall, text = run(src, again, once_db, {}, tmp / "again.log", "--batch-name", "second pass")
    from worker.store.store import Store

    store = Store(once_db)
    second = store.get_batch("second pass")
    jobs = store.jobs(second.id)
    store.dispose()
    cached = sum(1 for j in jobs if j.cached)
    started_worker = "starting one" in text
    identical = normalized(again) == normalized(once_out)
    say(f"second run: {cached} of {len(jobs)} rows from the cache; worker started: {'yes' if started_worker else 'no'}; "
        f"claims {sum(j.attempts for j in jobs)}; output {'identical' if identical else 'DIFFERENT'} to the first "
        f"apart from timings and ids; command {wall:.2f} s")
    server = RedisServer(tmp)
    try:
        alone_db = f"sqlite:///{tmp / 'alone.db'}"
        alone, _ = run(src, tmp / "alone.out.jsonl", alone_db, {"SPECBATCH_CACHE": "0"}, tmp / "alone.log",
                       "--detach", "--no-local-worker", broker=server.url)
    finally:
        server.stop()
    say(f"ingesting the file alone (--detach, a fresh store): {alone:.2f} s; the cached run is {wall / alone:.2f}x "
        f"of it (goal <= 2x: {'met' if wall <= 2 * alone else 'NOT met'})")
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        say(f"work folder: {tmp}")


if __name__ == "__main__":
    main()
