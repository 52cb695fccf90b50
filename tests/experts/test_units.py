"""Grid names, schemas, compression and the batch scheduler, without a network."""

from __future__ import annotations

import asyncio

import pytest
import torch

from experts import ExpertBackend, ExpertSchemaError, TensorSchema, expand_pattern, parse_uid
from experts.batching import BatchScheduler, TaskPool
from experts.grid import prefix_key
from experts.runtime import Runtime
from p2p.codecs import compress, restore


def test_uids_parse_into_prefix_and_coordinates():
    assert parse_uid("ffn.3.7") == ("ffn", (3, 7))
    assert parse_uid("layer.2.ffn.0") == ("layer.2.ffn", (0,))
    assert prefix_key("ffn", (3,)) == "ffn.3."
    assert prefix_key("ffn") == "ffn."
    for bad in ["ffn", "3.4", "ffn.03", "ffn.-1", "ffn..1", ".1", "a/b.1"]:
        with pytest.raises(ValueError, match="prefix.i0.i1"):
            parse_uid(bad)


def test_patterns_expand_to_every_uid_of_the_grid():
    assert expand_pattern("ffn.[0:2].[1:3]") == ["ffn.0.1", "ffn.0.2", "ffn.1.1", "ffn.1.2"]
    assert expand_pattern("ffn.5.[0:2]") == ["ffn.5.0", "ffn.5.1"]
    with pytest.raises(ValueError):
        expand_pattern("ffn.[2:1]")


def test_schema_errors_name_the_expert_and_the_expected_schema():
    backend = ExpertBackend.from_kind("ffn.1", "ffn", 8)
    assert backend.args_schema == (TensorSchema((8,), torch.float32),)
    assert backend.outputs_schema == (TensorSchema((8,), torch.float32),)
    assert backend.check_inputs([torch.zeros(3, 8)]) == 3
    for wrong in ([torch.zeros(3, 9)], [torch.zeros(3, 8, dtype=torch.float64)], [torch.zeros(8)], [],
                  [torch.zeros(3, 8), torch.zeros(3, 8)], "x"):
        with pytest.raises(ExpertSchemaError) as e:
            backend.check_inputs(wrong)
        assert "'ffn.1'" in str(e.value) and "float32[batch, 8]" in str(e.value)
    with pytest.raises(ExpertSchemaError, match="with 3 rows"):
        backend.check_grad_outputs([torch.zeros(4, 8)], rows=3)


def test_transformer_schema_leaves_the_sequence_length_open():
    backend = ExpertBackend.from_kind("tf.0", "transformer", 16)
    assert backend.args_schema == (TensorSchema((None, 16), torch.float32),)
    assert backend.check_inputs([torch.zeros(2, 5, 16)]) == 2
    assert backend.check_inputs([torch.zeros(2, 7, 16)]) == 2


def test_compression_halves_floats_and_restores_dtypes():
    x = torch.randn(4, 8)
    idx = torch.arange(4)
    wire = compress([x, idx, None], "float16")
    assert wire[0].dtype == torch.float16 and wire[1] is idx and wire[2] is None
    back = restore(wire, [torch.float32, torch.int64, None])
    assert back[0].dtype == torch.float32 and torch.allclose(back[0], x, atol=1e-2)


async def test_requests_queued_together_run_as_one_batch_and_split_back():
    runtime = Runtime()
    scheduler = BatchScheduler(runtime)
    seen: list[int] = []

    def double(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        seen.append(inputs[0].shape[0])
        return [inputs[0] * 2]

    pool = scheduler.add_pool(TaskPool("double", double, max_batch_size=6))
    scheduler.start()
    try:
        xs = [torch.full((n, 2), float(i)) for i, n in enumerate([1, 2, 3, 4])]
        # all four are queued before the scheduler runs; the fourth does not fit in 6 rows
        outs = await asyncio.gather(*(scheduler.submit(pool, [x], x.shape[0]) for x in xs))
    finally:
        await scheduler.stop()
        runtime.shutdown()
    assert seen == [6, 4]
    for x, (out,) in zip(xs, outs, strict=True):
        assert torch.equal(out, x * 2)


async def test_a_failing_batch_fails_its_requests_and_the_scheduler_goes_on():
    runtime = Runtime()
    scheduler = BatchScheduler(runtime)
    calls = []

    def flaky(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(inputs[0].shape[0])
        if len(calls) == 1:
            raise RuntimeError("boom")
        return [inputs[0] + 1]

    pool = scheduler.add_pool(TaskPool("flaky", flaky, max_batch_size=8))
    scheduler.start()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            await scheduler.submit(pool, [torch.zeros(2, 1)], 2)
        (out,) = await scheduler.submit(pool, [torch.zeros(3, 1)], 3)
    finally:
        await scheduler.stop()
        runtime.shutdown()
    assert torch.equal(out, torch.ones(3, 1))


async def test_batch_timeout_waits_for_the_pool_to_fill():
    runtime = Runtime()
    scheduler = BatchScheduler(runtime, batch_timeout=30.0)  # would be slow if it waited the whole timeout
    seen: list[int] = []

    def ident(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        seen.append(inputs[0].shape[0])
        return inputs

    pool = scheduler.add_pool(TaskPool("ident", ident, max_batch_size=4))
    scheduler.start()
    try:
        first = asyncio.ensure_future(scheduler.submit(pool, [torch.zeros(1, 1)], 1))
        for _ in range(5):
            await asyncio.sleep(0)  # the scheduler now waits for more rows
        assert not first.done()
        rest = [asyncio.ensure_future(scheduler.submit(pool, [torch.zeros(1, 1)], 1)) for _ in range(3)]
        await asyncio.wait_for(asyncio.gather(first, *rest), 10)  # 4 rows: full, runs at once
    finally:
        await scheduler.stop()
        runtime.shutdown()
    assert seen == [4]
