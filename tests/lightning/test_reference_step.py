"""A module's ``reference_step`` under pipeline parallelism (:meth:`PipelinedSteps._with_reference`): run as a
forward-only schedule of its own without gradients, what it returns merged into each micro-batch on the last stage
only; a module without one runs as before; what it cannot merge, or a log call in it, is refused by name."""

from types import SimpleNamespace

import pytest
import torch

from lightning_seqpar.lightning.pipelined_steps import PipelinedSteps
from lightning_seqpar.pipeline_parallel.executor import StepResult


class _Executor:
    """Runs each micro-batch's step in order, as a forward-only schedule's last stage would, and records the call."""

    def __init__(self):
        self.calls = []

    def run(self, step, forward_only=False, signature=None, before_last_backward=None):
        self.calls.append((forward_only, signature, torch.is_grad_enabled()))
        result = StepResult()
        for i in range(2):
            result.outputs[i] = step(i)
        return result


def _steps(is_last):
    steps = PipelinedSteps.__new__(PipelinedSteps)  # the merge only: no pipeline group needed
    steps.executor, steps.is_last = _Executor(), is_last
    return steps


class _Module:
    def __init__(self, reference_step):
        self.reference_step = reference_step


MICRO = [{"x": torch.ones(2, 3)}, {"x": torch.zeros(2, 3)}]


@pytest.mark.parametrize("is_last", [True, False])
def test_what_reference_step_returns_joins_each_micro_batch_on_the_last_stage(is_last):
    steps = _steps(is_last)
    module = _Module(lambda batch, i: {"reference_logps": batch["x"].sum(-1), "grad": torch.is_grad_enabled()})
    merged = steps._with_reference(module, MICRO, 7)
    (forward_only, signature, grad_enabled), = steps.executor.calls
    assert forward_only and signature == (True, (((2, 3), torch.float32),)) and not grad_enabled
    if is_last:
        assert [m["reference_logps"].tolist() for m in merged] == [[3.0, 3.0], [0.0, 0.0]]
        assert all(m["grad"] is False and torch.equal(m["x"], b["x"]) for m, b in zip(merged, MICRO))
    else:  # the earlier stages never compute it: their micro-batches stay as they are
        assert merged is MICRO


def test_a_module_without_reference_step_runs_no_extra_schedule():
    steps = _steps(True)
    assert steps._with_reference(_Module(None), MICRO, 0) is MICRO
    assert steps._with_reference(SimpleNamespace(), MICRO, 0) is MICRO and steps.executor.calls == []


def test_what_cannot_be_merged_and_a_log_call_are_refused_by_name():
    steps = _steps(True)
    with pytest.raises(TypeError, match="returned a Tensor: under pipeline parallelism it returns a dict"):
        steps._with_reference(_Module(lambda batch, i: batch["x"]), MICRO, 0)
    with pytest.raises(TypeError, match="micro-batch, which must be a dict; got a list"):
        steps._with_reference(_Module(lambda batch, i: {}), [[torch.ones(1)], [torch.ones(1)]], 0)

    class Logging(_Module):
        pass

    module = Logging(None)
    module.reference_step = lambda batch, i: module.log("ref", 1.0)
    with pytest.raises(RuntimeError, match="Logging.reference_step logged 'ref'.*Log in training_step"):
        steps._with_reference(module, MICRO, 0)
    assert not hasattr(module, "log")  # the stand-in is gone after the schedule
