"""Parity of the built-in models with transformers on tiny random-weight checkpoints.

Every comparison runs our model through a minimal paged runner (block size
16, shuffled non-contiguous blocks, all requests of a step flattened into one
batch) and checks its logits against transformers' model run on the whole
sequence without a cache.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from fw.forward_context import set_forward_context
from fw.interfaces.attention import AttentionBatch
from fw.model_loader import load_model, resolve_dtype
from fw.models import specs
from fw.models.base import HFConfig, ModelContext
from fw.sdk.checkpoint import iter_safetensors
from fw.sdk.errors import CheckpointNotFoundError, MissingWeightsError, ModelLoadError
from fw.testing.models import ARCHITECTURES, VOCAB_SIZE
from fw_attention_torch.backend import TorchAttention
from fw_quant_none.method import Unquantized

# transformers is imported only where a reference is needed, so that the tensor-parallel worker
# processes, which import this module, start fast.

MODEL_CLASSES = {
    arch: spec.load()
    for spec in (
        specs.LLAMA, specs.QWEN2, specs.QWEN3, specs.MIXTRAL, specs.QWEN2_MOE, specs.QWEN3_MOE, specs.DEEPSEEK_V2,
        specs.DEEPSEEK_V3,
    )
    for arch in spec.capabilities.architectures
}
FP32_TOL = 1e-4
# bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%), and our kernels round at other points than
# transformers' (fused q/k/v and gate/up matmuls, paged attention). On these tiny models, whose logits have a
# standard deviation of about 0.65, every logit stays within BF16_TOL = 0.1 of transformers' bf16 logit
# (observed: <= 0.035) and the mean difference below BF16_MEAN_TOL = 0.02 (observed: <= 0.005 dense, 0.013 MoE).
# MoE exception: where two experts' router scores are within bf16 rounding of each other, the two
# implementations may pick different experts for that token (transformers' own bf16 run does so against its
# fp32 run on the same prompts), which moves that token's logits by up to ~1. Up to 10% of the tokens of an
# MoE model may exceed BF16_TOL for that reason.
BF16_TOL = 0.1
BF16_MEAN_TOL = 0.02
BF16_MOE_OUTLIERS = 0.1
MOE_ARCHITECTURES = {
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
}
PROMPT_LENS = (37, 5, 20)


class PagedRunner:
    """The least a model runner does: paged KV caches and the step's AttentionBatch."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, block_size: int = 16, num_blocks: int = 48):
        self.model = model
        self.backend = TorchAttention()
        self.block_size = block_size
        # NaN-filled, so that attending to any slot never written turns the logits into NaN.
        specs = [self.backend.kv_cache_spec(s, block_size, dtype) for s in model.attention_specs()]
        self.caches = [torch.full(spec.shape(num_blocks), float("nan"), dtype=spec.dtype) for spec in specs]
        # Block 0 only pads block tables; the others are handed out in shuffled order.
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed each request its next tokens; return each request's logits, one row per token."""
        ids, positions, computed, new, tables = [], [], [], [], []
        for rid, tokens in chunks.items():
            begin = self.lens.get(rid, 0)
            end = self.lens[rid] = begin + len(tokens)
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop())
            ids += tokens
            positions += range(begin, end)
            computed.append(begin)
            new.append(len(tokens))
            tables.append(blocks)
        batch = AttentionBatch.build(tables, computed, new, self.block_size)
        with torch.no_grad(), set_forward_context(self.backend.prepare(batch), self.caches):
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(positions)))
        starts = batch.query_start_loc_cpu
        return {rid: logits[starts[i] : starts[i + 1]] for i, rid in enumerate(chunks)}


def load_ours(path, dtype=torch.float32):
    config = HFConfig.from_file(path / "config.json")
    ctx = ModelContext(dtype=dtype, quant=Unquantized(), attention=TorchAttention())
    return load_model(MODEL_CLASSES[config.architecture], config, ctx, iter_safetensors(path))


def load_reference(path, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def prompts(lengths=PROMPT_LENS, seed=0) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids past the 3 special tokens, within the tokenizer's vocabulary.
    return {rid: torch.randint(3, 500, (n,), generator=gen).tolist() for rid, n in enumerate(lengths)}


def generate(model, dtype, prompt_tokens: dict[int, list[int]], decode_steps: int):
    """Prefill every prompt in one step, then decode greedily, one token per request per step.

    Returns the tokens fed to the model and the logits it gave for each, per request.
    """
    runner = PagedRunner(model, dtype)
    logits = runner.step(prompt_tokens)
    fed = {rid: list(tokens) for rid, tokens in prompt_tokens.items()}
    for _ in range(decode_steps):
        next_tokens = {rid: [int(rows[-1].argmax())] for rid, rows in logits.items()}
        for rid, rows in runner.step(next_tokens).items():
            fed[rid] += next_tokens[rid]
            logits[rid] = torch.cat([logits[rid], rows])
    return fed, logits


def compare_with_reference(path, dtype, lengths=PROMPT_LENS, decode_steps=4):
    """(max |ours - transformers| of each logits row, mean |ours - transformers| over all logits)."""
    ours = load_ours(path, dtype)
    fed, logits = generate(ours, dtype, prompts(lengths), decode_steps)
    reference = load_reference(path, dtype)
    diffs = torch.cat([(logits[rid] - reference_logits(reference, tokens)).abs() for rid, tokens in fed.items()])
    return diffs.amax(dim=-1), diffs.mean().item()


def assert_matches_reference(path, dtype=torch.float32, tol=FP32_TOL, **kwargs):
    row_diffs, _ = compare_with_reference(path, dtype, **kwargs)
    assert row_diffs.max() < tol, f"max |ours - transformers| = {row_diffs.max():.2e} >= {tol}"


def test_specs_cover_every_test_architecture():
    assert set(MODEL_CLASSES) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_prefill_and_decode_match_transformers_fp32(checkpoint, arch):
    assert_matches_reference(checkpoint(arch))


def test_tied_embeddings(checkpoint):
    path = checkpoint("Qwen2ForCausalLM", tie_word_embeddings=True)
    with torch.no_grad():
        model = load_ours(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_matches_reference(path)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_prefill_and_decode_match_transformers_bf16(checkpoint, arch):
    row_diffs, mean_diff = compare_with_reference(checkpoint(arch), torch.bfloat16, decode_steps=2)
    outliers = int((row_diffs >= BF16_TOL).sum())
    assert outliers <= (BF16_MOE_OUTLIERS if arch in MOE_ARCHITECTURES else 0) * len(row_diffs), (
        f"{outliers} of {len(row_diffs)} tokens differ from transformers by >= {BF16_TOL} (max {row_diffs.max():.2f})"
    )
    assert mean_diff < BF16_MEAN_TOL


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_tokens_are_the_argmax_of_the_logits(checkpoint, arch):
    """A model's greedy_tokens, where it gives them (a bf16 head with dense.argmax's int8 bound, on CPUs with VNNI),
    are each row's argmax of its compute_logits: what the sampler would take."""
    with torch.no_grad():
        model = load_ours(checkpoint(arch), torch.bfloat16)
        hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
        tokens = model.greedy_tokens(hidden)
        if tokens is not None:
            assert torch.equal(tokens, model.compute_logits(hidden).argmax(dim=-1))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM"])
def test_chunked_prefill_matches_one_shot(checkpoint, arch):
    model = load_ours(checkpoint(arch))
    tokens = prompts((37, 6))
    one_shot = PagedRunner(model, torch.float32).step({0: tokens[0]})[0]

    # Request 0 arrives in chunks of 7 while request 1 prefills and then decodes alongside it.
    runner = PagedRunner(model, torch.float32)
    chunks, other = [], {1: tokens[1]}
    for start in range(0, len(tokens[0]), 7):
        step = runner.step({0: tokens[0][start : start + 7], **other})
        chunks.append(step[0])
        other = {1: [int(step[1][-1].argmax())]}
    diff = (torch.cat(chunks) - one_shot).abs().max().item()
    assert diff < FP32_TOL


@pytest.mark.parametrize(
    ("arch", "window", "sliding_layers"),
    [
        ("MistralForCausalLM", {"sliding_window": 8}, [0, 1]),
        # Qwen2: the window only applies from max_window_layers on.
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, [1]),
    ],
)
def test_sliding_window_matches_transformers(checkpoint, arch, window, sliding_layers):
    path = checkpoint(arch, **window)
    model = load_ours(path)
    assert [i for i, s in enumerate(model.attention_specs()) if s.sliding_window == 8] == sliding_layers
    # 37 tokens against a window of 8, then decode steps that keep sliding across block boundaries.
    assert_matches_reference(path, decode_steps=6)
    # The window must matter for these prompts, or the comparison above proves nothing.
    tokens = prompts()[0]
    windowed = reference_logits(load_reference(path), tokens)
    full = reference_logits(load_reference(checkpoint(arch)), tokens)
    assert (windowed - full).abs().max() > 1e-2


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(checkpoint, rope_type):
    path = checkpoint("LlamaForCausalLM", rope_parameters=ROPE_SCALINGS[rope_type])
    assert_matches_reference(path, lengths=(90, 9), decode_steps=2)


def test_legacy_rope_config_reads_like_rope_parameters():
    legacy = HFConfig(
        {"rope_theta": 500000.0, "max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    )
    assert legacy.rope_parameters() == {
        "type": "yarn",
        "factor": 4.0,
        "rope_type": "yarn",
        "rope_theta": 500000.0,
        "original_max_position_embeddings": 4096,
    }
    assert HFConfig({}).rope_parameters() == {"rope_type": "default", "rope_theta": 10000.0}


def test_sharded_checkpoint_loads(checkpoint):
    path = checkpoint("Qwen2MoeForCausalLM", sharded=True)
    assert len(list(path.glob("model-*.safetensors"))) > 1
    tokens = prompts((12,))
    sharded = PagedRunner(load_ours(path), torch.float32).step(tokens)[0]
    single = PagedRunner(load_ours(checkpoint("Qwen2MoeForCausalLM")), torch.float32).step(tokens)[0]
    assert torch.equal(sharded, single)


def test_missing_shard_is_named(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("Qwen2MoeForCausalLM", sharded=True), tmp_path / "ckpt")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointNotFoundError, match=victim.name) as info:
        next(iter_safetensors(path))
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ModelLoadError)
    with pytest.raises(CheckpointNotFoundError, match="model.safetensors"):
        next(iter_safetensors(tmp_path))


@pytest.mark.parametrize(
    ("dropped", "missing"),
    [
        ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
        # One part of a fused parameter leaves the whole parameter unloaded.
        ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
        ("model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.2.mlp.experts.w2_weight"),
    ],
)
def test_missing_parameter_is_named(checkpoint, dropped, missing):
    path = checkpoint("Qwen2MoeForCausalLM")
    config = HFConfig.from_file(path / "config.json")
    ctx = ModelContext(dtype=torch.float32, quant=Unquantized(), attention=TorchAttention())
    weights = ((n, t) for n, t in iter_safetensors(path) if n != dropped)
    with pytest.raises(MissingWeightsError, match=missing.replace(".", r"\.")) as info:
        load_model(MODEL_CLASSES[config.architecture], config, ctx, weights)
    assert info.value.names == [missing]


def test_unknown_checkpoint_tensor_is_an_error(checkpoint):
    path = checkpoint("LlamaForCausalLM")
    config = HFConfig.from_file(path / "config.json")
    ctx = ModelContext(dtype=torch.float32, quant=Unquantized(), attention=TorchAttention())
    weights = [*iter_safetensors(path), ("model.layers.0.mlp.surprise.weight", torch.zeros(1))]
    with pytest.raises(ModelLoadError, match="surprise"):
        load_model(MODEL_CLASSES[config.architecture], config, ctx, weights)


def test_resolve_dtype():
    assert resolve_dtype(HFConfig({"torch_dtype": "bfloat16"})) is torch.bfloat16
    assert resolve_dtype(HFConfig({"dtype": "float16"}), "float32") is torch.float32
    assert resolve_dtype(HFConfig({}), torch.bfloat16) is torch.bfloat16
    with pytest.raises(ModelLoadError, match="int8"):
        resolve_dtype(HFConfig({"dtype": "int8"}))


def _tp_worker(rank: int, init_method: str, paths: list, out_file, expert_parallel: bool, decode_steps: int) -> None:
    from fw.distributed import ParallelLayout, destroy_parallel, init_parallel
    from fw.layers.moe import FusedMoE
    from fw.sdk.torch_distributed import TorchDistributed

    torch.set_num_threads(1)
    layout = ParallelLayout(tensor_parallel_size=2, expert_parallel=expert_parallel)
    init_parallel(TorchDistributed, rank, layout, init_method, "cpu")
    try:
        results = []
        for path in paths:
            model = load_ours(path)
            assert model.lm_head.weight.shape[0] == VOCAB_SIZE // 2, "the vocabulary should be split over 2 ranks"
            for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
                assert moe.w13_weight.shape[0] == moe.num_experts // (2 if expert_parallel else 1), "expert sharding"
            results.append(generate(model, torch.float32, prompts(), decode_steps))
        if rank == 0:
            torch.save(results, out_file)
    finally:
        destroy_parallel(TorchDistributed)


@pytest.mark.slow
def test_tensor_parallel_2_matches_single_rank(checkpoint, tmp_path):
    """Two gloo ranks: heads, KV heads (replicated when fewer than ranks), MLP and expert widths, and the
    vocabulary are split; greedy tokens and logits must equal the single-rank run."""
    paths = [
        checkpoint("Qwen2MoeForCausalLM"),
        checkpoint("Qwen3ForCausalLM", num_key_value_heads=1, tie_word_embeddings=True),
        checkpoint("MixtralForCausalLM"),
    ]
    assert_tp2_matches_single_rank(paths, tmp_path)


def assert_tp2_matches_single_rank(paths, tmp_path, expert_parallel=False, decode_steps=3):
    """Each checkpoint on two gloo ranks (experts sharded whole with ``expert_parallel``): greedy tokens and logits
    equal the single-rank run's."""
    pytest.importorskip("fw_comm_torch")
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    out_file = tmp_path / "tp2.pt"
    args = (init_method, paths, out_file, expert_parallel, decode_steps)
    workers = [ctx.Process(target=_tp_worker, args=(rank, *args)) for rank in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    for path, (fed, logits) in zip(paths, torch.load(out_file), strict=True):
        single_fed, single_logits = generate(load_ours(path), torch.float32, prompts(), decode_steps)
        assert fed == single_fed, path.name
        for rid in fed:
            assert (logits[rid] - single_logits[rid]).abs().max() < FP32_TOL, path.name
