import pytest

from fw import LLM, SamplingParams
from fw.testing.conformance import QuantConformance, QuantFixture, plain_checkpoint, plain_weights
from fw.testing.models import make_tiny_model
from fw_quant_rtn.method import quantize_rows


def rtn_weights(checkpoint, options):
    """The plugin's own reading of a plain checkpoint: each linear layer's weight (the 2-D tensors of the decoder
    layers) as int8 rows times their scales, except the layers ``skip`` names."""
    for name, tensor in plain_weights(checkpoint, options):
        module = name.removesuffix(".weight")
        if ".layers." in name and tensor.dim() == 2 and module.rpartition(".")[2] not in options.skip:
            q, scale = quantize_rows(tensor)
            tensor = q.float() * scale[:, None]
        yield name, tensor


class TestRtnConformance(QuantConformance):
    plugin = "rtn"
    # Per-row int8 keeps a random Gaussian layer within 0.7% of its float product; the suite checks 2%.
    fixtures = {"none": QuantFixture(plain_checkpoint, rtn_weights, 0.02)}


class TestRtnSkippingConformance(TestRtnConformance):
    options = {"skip": ["o_proj", "down_proj"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("rtn") / "llama"))


def test_auto_keeps_the_unquantized_default(model):
    # Installed beside the built-ins, rtn loads plain checkpoints too, but only when asked for.
    llm = LLM(model, num_kv_blocks=16, max_model_len=128, device="cpu")
    assert llm.llm_engine.selected["quant"] == "none"
    llm.shutdown()


def test_generates_with_layers_skipped(model):
    llm = LLM(model, quant="rtn", plugin_options={"quant": {"skip": ["o_proj"]}}, num_kv_blocks=16,
              max_model_len=128, device="cpu")
    layers = dict(llm.llm_engine.executor.runner.model.named_modules())
    assert hasattr(layers["model.layers.0.self_attn.qkv_proj"], "qweight")
    assert not hasattr(layers["model.layers.0.self_attn.o_proj"], "qweight")
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.shutdown()
