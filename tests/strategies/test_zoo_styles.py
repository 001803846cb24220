"""The zoo's tensor-parallel styles: every style a causal LM of transformers declares is translated
(or kept whole) by shardwise, or refused by name, never left to the catch-all "does not know".

The zoo is every ``*ForCausalLM`` transformers maps a config to (benchmarks/zoo_models.py), read
without building the models: each config's ``base_model_tp_plan`` (and its text config's), and the
``_tp_plan`` each modeling file gives its classes (the output head's style). For each style, one
model that declares it is built small and `declared_plan` is asked about that one entry of its plan
(the pattern on the module or parameter it names there), next to the same entry with a style no
one declares: the made-up style must be refused (a style shardwise does not know never trains),
and the real one must either translate or be refused with a message of its own that names it. A new
transformers release that adds a style fails here until shardwise translates or refuses it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from shardwise.errors import ConfigError
from shardwise.strategies.tensor_parallel.plan import declared_plan

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MADE_UP = "zz_style_no_one_declares"


def _zoo_models() -> Any:
    if "zoo_models" not in sys.modules:
        spec = importlib.util.spec_from_file_location("zoo_models", BENCHMARKS / "zoo_models.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["zoo_models"] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["zoo_models"]


def _class_plans() -> dict[str, dict[str, str]]:
    """``{class name: _tp_plan}`` as the modeling files write them (read, not imported)."""
    import transformers

    plans: dict[str, dict[str, str]] = {}
    for path in sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
        text = path.read_text(errors="replace")
        for m in re.finditer(r"^class (\w+)\(.*?(?=^class |\Z)", text, re.S | re.M):
            plan = re.search(r"^\s+_tp_plan\s*=\s*\{([^}]*)\}", m.group(0), re.M)
            if plan:
                plans[m.group(1)] = dict(re.findall(r"[\"']([^\"']+)[\"']\s*:\s*[\"']([^\"']+)[\"']", plan.group(1)))
    return plans


def declared_styles() -> dict[str, list[str]]:
    """``{style: [model types declaring it]}`` over the zoo's causal LMs whose config or class
    declares a tensor-parallel plan."""
    zm = _zoo_models()
    classes = _class_plans()
    styles: dict[str, list[str]] = {}
    for model_type, cls in zm.catalogue().items():
        try:
            cfg = zm.default_config(model_type)
        except Exception:  # a config that does not build with its defaults: not in the zoo here
            continue
        plans = [zm.tp_plan_of(cfg)] + [zm.tp_plan_of(getattr(cfg, k)) for k in ("text_config",) if getattr(cfg, k, None) is not None]
        if not any(plans):
            continue
        plans.append(classes.get(cls, {}))
        for style in {str(s) for p in plans for s in p.values()}:
            styles.setdefault(style, []).append(model_type)
    return styles


def _verdict(model: Any, pattern: str, style: str) -> str | None:
    """What `declared_plan` makes of ``{pattern: style}`` on ``model``: None when it translates or
    keeps it, else the refusal's message."""
    saved = model._tp_plan
    model._tp_plan = {pattern: style}
    try:
        declared_plan(model)
        return None
    except ConfigError as exc:
        return str(exc)
    finally:
        model._tp_plan = saved


def test_every_style_the_zoo_declares_is_translated_or_refused_by_name() -> None:
    zm = _zoo_models()
    styles = declared_styles()
    assert len({m for ms in styles.values() for m in ms}) >= 100, "the zoo should hold ~116 causal LMs declaring a tp plan"
    assert {"colwise", "rowwise", "moe_tp_experts", "packed_colwise"} <= set(styles)
    untranslated, unbuilt = {}, []
    for style, models in sorted(styles.items()):
        for model_type in models:  # the first that builds small here
            try:
                model = zm.build(model_type)
            except Exception:
                continue
            entry = next(((p, s) for p, s in model._tp_plan.items() if s == style), None)
            if entry is not None:
                break
        else:
            unbuilt.append(style)
            continue
        pattern = entry[0]
        made_up = _verdict(model, pattern, MADE_UP)
        assert made_up is not None and MADE_UP in made_up, f"a made-up style on {model_type}'s {pattern!r} was not refused: {made_up}"
        verdict = _verdict(model, pattern, style)
        if verdict is not None and (style not in verdict or verdict == made_up.replace(MADE_UP, style)):
            untranslated[style] = f"{model_type} {pattern!r}: {verdict.splitlines()[0][:200]}"
    assert not untranslated, f"styles transformers declares that shardwise neither translates nor refuses by name: {untranslated}"
    assert len(unbuilt) <= 3, f"styles no model declaring them builds small here (unchecked): {unbuilt}"
