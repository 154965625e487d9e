"""train/fsdp.py in this process, sharded over a one-rank gloo group on an in-memory store: what each
``parallelism`` option changes, the gradient clipping on DTensor gradients, the whole-model state dict."""

from __future__ import annotations

import pytest
import torch

from sbatch_gen.train.config import ParallelismConfig, load_config
from sbatch_gen.train.model import GPT

from .conftest import TINY

CPU = torch.device("cpu")


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(load_config(TINY).model.model_copy(update={"dropout": 0.0}))  # the same forward every time


def _sharded(one_rank, **options):
    from sbatch_gen.train.fsdp import shard

    model = _gpt()
    return model, shard(model, ParallelismConfig(kind="fsdp", **options), one_rank, CPU, None)


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode, reduced_early", [("sharded", True), ("unsharded", False)])
def test_grad_accumulation_reduces_every_micro_batch_or_only_the_last(one_rank, mode, reduced_early):
    """sharded: a micro-batch before the last already leaves its reduce-scattered gradient shards;
    unsharded: FSDP holds the full gradients back until the last micro-batch's backward."""
    model, par = _sharded(one_rank, grad_accumulation=mode)
    x = _batch()
    with par.no_sync():
        model(x, x).backward()
    assert {p.grad is not None for p in model.parameters()} == {reduced_early}
    model(x, x).backward()  # the last micro-batch
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_frees_or_keeps_the_gathered_blocks(one_rank, reshard):
    from torch.distributed.tensor import DTensor

    model, _ = _sharded(one_rank, reshard_after_forward=reshard)
    x = _batch()
    loss = model(x, x)
    # between forward and backward: a resharded block holds its DTensor shards again, else its full tensors
    assert {isinstance(p, DTensor) for p in model.blocks[0].parameters()} == {reshard}
    loss.backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_clipping_dtensor_gradients_equals_clipping_the_plain_model(one_rank):
    """The norm of the local shards is reduced over the ranks before it scales them: at one rank exactly
    torch's clip_grad_norm_ on the unsharded model, bit for bit."""
    from sbatch_gen.train.gradnorm import clip_grads

    plain = _gpt()
    model, _ = _sharded(one_rank)
    x = _batch()
    for m in (plain, model):
        m(x, x).backward()
    want = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.01, foreach=True)
    got = clip_grads(list(model.parameters()), 0.01, CPU)
    assert type(got) is torch.Tensor and torch.equal(got, want)
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(q.grad.full_tensor(), p.grad), name


def test_full_state_dict_is_the_plain_models(one_rank):
    plain = _gpt()
    _, par = _sharded(one_rank, cpu_offload=True)
    full = par.full_state_dict()
    want = plain.state_dict()
    assert full.keys() == want.keys()
    assert all(type(v) is torch.Tensor and torch.equal(v, want[k]) for k, v in full.items())
    assert par.param_device == CPU and par.amp_dtype is None and par.comm is None


def test_bf16_computes_in_bf16_and_keeps_fp32_shards_and_gradients(one_rank):
    """train.precision bf16: the policy gathers bf16 parameters for compute, no autocast; the shards,
    their gradients (reduced in fp32) and so AdamW stay fp32."""
    from sbatch_gen.train.fsdp import shard

    model = _gpt()
    par = shard(model, ParallelismConfig(kind="fsdp"), one_rank, CPU, torch.bfloat16)
    seen = []
    model.blocks[0].mlp.up.register_forward_hook(
        lambda m, args, out: seen.append((m.weight.dtype, out.dtype))
    )
    x = _batch()
    model(x, x).backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)] and par.amp_dtype is None
    assert {(p.dtype, p.grad.dtype) for p in model.parameters()} == {(torch.float32, torch.float32)}
