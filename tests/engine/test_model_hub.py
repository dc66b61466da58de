"""Model sources: a GGUF file is dequantised once and loads like any HF directory."""

from pathlib import Path

import pytest

from engine.model_hub import cache_dir, resolve_model

pytestmark = pytest.mark.slow


def test_gguf_file_loads_with_tokenizer_and_chat_template(smollm2_dir, tmp_path, monkeypatch):
    gguf = next((cache_dir() / "gguf").glob("*.gguf"))  # fetched by resolve_model("SmolLM2-135M-Instruct")
    monkeypatch.setenv("SPECBATCH_CACHE_DIR", str(tmp_path))
    converted = Path(resolve_model(str(gguf)))
    assert converted.parent == tmp_path / "models"
    assert (converted / "config.json").exists() and list(converted.glob("*.safetensors"))
    assert "quantization_config\": null" in (converted / "config.json").read_text() or (
        "quantization_config" not in (converted / "config.json").read_text()
    )
    assert resolve_model(str(gguf)) == str(converted)  # cached: no second conversion

    from engine import LLM, SamplingParams

    llm = LLM(str(gguf), device="cpu")
    assert llm.tokenizer.chat_template
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_unknown_gguf_path_is_a_clear_error():
    with pytest.raises(ValueError, match="GGUF file not found"):
        resolve_model("/nonexistent/model.gguf")
