"""Knowledge distillation (`shardwise.tools.compress.distill`): the loss against Hinton et al.'s formula, the frozen teacher."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.tools.compress.distill import Distillation, distillation_loss


def _by_hand(s: list[list[float]], t: list[list[float]], y: list[int], T: float, a: float, b: float) -> float:
    """Hinton et al. 2015, section 2, written out in plain Python: a T^2 KL(p_t || p_s) + b CE(s, y), means over rows."""

    def softmax(z: list[float], temp: float) -> list[float]:
        e = [math.exp(v / temp) for v in z]
        return [v / sum(e) for v in e]

    kl = ce = 0.0
    for si, ti, yi in zip(s, t, y, strict=True):
        ps, pt = softmax(si, T), softmax(ti, T)
        kl += sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt, ps, strict=True))
        ce += -math.log(softmax(si, 1.0)[yi])
    return a * T * T * kl / len(s) + b * ce / len(s)


@pytest.mark.parametrize(("T", "a", "b"), [(1.0, 1.0, 0.0), (4.0, 0.9, 0.1), (2.5, 0.3, 0.7)])
def test_loss_equals_the_formula(T, a, b):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 5, generator=g, dtype=torch.float64), 3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (6,), generator=g)
    got = distillation_loss(s, t, y, temperature=T, soft_weight=a, hard_weight=b)
    assert float(got) == pytest.approx(_by_hand(s.tolist(), t.tolist(), y.tolist(), T, a, b), rel=1e-6)


def test_sequence_logits_count_every_position_as_a_sample():
    g = torch.Generator().manual_seed(1)
    s, t, y = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g), torch.randint(0, 7, (2, 3), generator=g)
    flat = _by_hand(s.reshape(6, 7).tolist(), t.reshape(6, 7).tolist(), y.reshape(6).tolist(), 2.0, 0.5, 0.5)
    assert float(distillation_loss(s, t, y, temperature=2.0)) == pytest.approx(flat, rel=1e-5)


def test_a_student_equal_to_its_teacher_has_no_soft_loss():
    z = torch.randn(4, 10)
    assert float(distillation_loss(z, z, torch.zeros(4, dtype=torch.long), soft_weight=1.0, hard_weight=0.0)) == pytest.approx(0.0, abs=1e-6)


def test_teacher_is_frozen_in_eval_mode_and_gets_no_gradient():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).train()
    before = [p.detach().clone() for p in teacher.parameters()]
    loss_fn = Distillation(teacher, temperature=3.0)
    student = nn.Linear(4, 3)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    teacher.train()  # even switched back to training mode, the loss runs it in eval (dropout off)
    loss = loss_fn(student(x), (x, y))
    loss.backward()
    assert not teacher.training and all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    assert student.weight.grad is not None
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters(), strict=True))
    with torch.no_grad():
        expected = distillation_loss(student(x), teacher.eval()(x), y, temperature=3.0)
    assert float(loss.detach()) == pytest.approx(float(expected))


def test_student_in_float64_with_a_float32_teacher():
    teacher = nn.Linear(4, 3)
    out = Distillation(teacher)(torch.randn(2, 3, dtype=torch.float64), (torch.randn(2, 4, dtype=torch.float64), torch.tensor([0, 1])))
    assert out.dtype == torch.float64


_BAD = [({"temperature": 0}, "temperature"), ({"soft_weight": -1}, "soft_weight"), ({"soft_weight": 0, "hard_weight": 0}, "not both 0")]


@pytest.mark.parametrize(("kwargs", "match"), _BAD)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Distillation(nn.Linear(2, 2), **kwargs)
