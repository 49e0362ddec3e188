"""JSON-schema extraction benchmark: jump-forward on vs off.

A batch of short biographies is turned into JSON objects with a fixed 6-field schema, once with
jump-forward off (every token costs a decode step) and once with it on (keys and punctuation the
schema forces are appended without one). Reports decode steps, engine forward steps, wall time
and output validity per mode. `run(engine_factory)` returns a dict; `format_report` prints it;
`python -m radix_backend.bench.json_bench` runs it on the embedded SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..sampling_params import SamplingParams

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "full_name": {"type": "string", "maxLength": 40},
        "age_in_years": {"type": "integer", "minimum": 0, "maximum": 120},
        "home_city": {"type": "string", "maxLength": 30},
        "occupation": {"type": "string", "maxLength": 40},
        "email_address": {"type": "string", "pattern": "^[a-z0-9._]{1,24}@[a-z0-9]{1,16}\\.(com|org|net)$"},
        "is_currently_student": {"type": "boolean"},
    },
    "required": ["full_name", "age_in_years", "home_city", "occupation", "email_address", "is_currently_student"],
    "additionalProperties": False,
}

SYSTEM = "You extract facts about a person from a short text and answer with one JSON object."
_NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "David Okafor", "Emma Schulz", "Farid Haddad", "Grace Kim",
          "Hugo Rossi", "Ines Costa", "Jonas Berg", "Keiko Tanaka", "Liam Walsh", "Maya Patel", "Noah Levi",
          "Olga Ivanova", "Pedro Silva"]
_CITIES = ["Paris", "Toronto", "Madrid", "Lagos", "Berlin", "Beirut", "Seoul", "Rome"]
_JOBS = ["nurse", "software engineer", "teacher", "chemistry student", "baker", "architect", "history student", "pilot"]


def make_prompts(n: int) -> list[list[dict[str, str]]]:
    """n deterministic chat prompts, each describing one person."""
    prompts = []
    for i in range(n):
        name, city, job = _NAMES[i % len(_NAMES)], _CITIES[i % len(_CITIES)], _JOBS[(3 * i) % len(_JOBS)]
        age = 19 + (7 * i) % 50
        email = name.lower().replace(" ", ".") + "@example.com"
        bio = f"{name} is {age} years old and lives in {city}. Works as a {job}. Contact: {email}."
        prompts.append([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Text: {bio}\nReturn the JSON object."}])
    return prompts


def _is_valid(text: str) -> bool:
    """Parses and validates against the schema (jsonschema when installed, else keys and types)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        types = {"string": str, "integer": int, "boolean": bool}
        props = PERSON_SCHEMA["properties"]
        return (isinstance(value, dict) and set(value) == set(props)
                and all(isinstance(value[k], types[p["type"]]) for k, p in props.items()))
    try:
        jsonschema.validate(value, PERSON_SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def _run_mode(engine: Any, prompts: list[list[dict[str, str]]], max_new_tokens: int) -> dict[str, Any]:
    params = SamplingParams(json_schema=PERSON_SCHEMA, temperature=0.0, max_new_tokens=max_new_tokens)
    # Warm-up (model, grammar compile cache), then start from an empty radix cache.
    engine.generate(messages=prompts[0], params=params.copy(max_new_tokens=8))
    engine.flush_cache()
    forward_before = engine.cache_stats().forward_steps
    start = time.perf_counter()
    outs = engine.generate(messages=prompts, params=[params] * len(prompts))
    wall = time.perf_counter() - start
    forward_steps = engine.cache_stats().forward_steps - forward_before
    decode_steps = sum(o.meta.decode_steps for o in outs)
    completion = sum(o.meta.completion_tokens for o in outs)
    return {
        "wall_s": wall,
        "decode_steps": decode_steps,
        "completion_tokens": completion,
        "forced_tokens": completion - decode_steps,
        "forward_steps": forward_steps,
        "tokens_per_s": completion / wall if wall > 0 else 0.0,
        "valid": sum(_is_valid(o.text) for o in outs),
        "finish_reasons": dict(Counter(o.finish_reason for o in outs)),
        "sample_output": outs[0].text,
    }


def run(engine_factory: Callable[..., Any], *, num_prompts: int = 16, max_new_tokens: int = 128) -> dict[str, Any]:
    """Run the workload with jump-forward off, then on.

    `engine_factory(enable_jump_forward=bool)` must return a fresh Engine; it is shut down here.
    """
    if num_prompts < 1:
        raise ValueError("num_prompts must be >= 1")
    prompts = make_prompts(num_prompts)
    modes: dict[str, dict[str, Any]] = {}
    for name, enabled in (("jump_forward_off", False), ("jump_forward_on", True)):
        engine = engine_factory(enable_jump_forward=enabled)
        try:
            modes[name] = _run_mode(engine, prompts, max_new_tokens)
        finally:
            engine.shutdown()
    off, on = modes["jump_forward_off"], modes["jump_forward_on"]
    return {
        "workload": {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
                     "fields": len(PERSON_SCHEMA["properties"]), "temperature": 0.0},
        "modes": modes,
        "decode_step_reduction": 1.0 - on["decode_steps"] / max(1, off["decode_steps"]),
        "forward_step_reduction": 1.0 - on["forward_steps"] / max(1, off["forward_steps"]),
        "wall_speedup": off["wall_s"] / on["wall_s"] if on["wall_s"] > 0 else float("nan"),
    }


def format_report(result: dict[str, Any]) -> str:
    w = result["workload"]
    lines = [f"JSON-schema extraction: {w['num_prompts']} prompts, {w['fields']} fields, greedy, "
             f"max_new_tokens={w['max_new_tokens']}",
             f"{'mode':<18}{'decode steps':>13}{'fwd steps':>10}{'tokens':>8}{'forced':>8}{'wall s':>9}"
             f"{'tok/s':>8}{'valid':>8}"]
    for name, m in result["modes"].items():
        lines.append(f"{name:<18}{m['decode_steps']:>13}{m['forward_steps']:>10}{m['completion_tokens']:>8}"
                     f"{m['forced_tokens']:>8}{m['wall_s']:>9.2f}{m['tokens_per_s']:>8.1f}"
                     f"{m['valid']:>5}/{w['num_prompts']}")
    lines.append(f"decode steps -{100 * result['decode_step_reduction']:.0f}%, forward steps "
                 f"-{100 * result['forward_step_reduction']:.0f}%, wall time x{result['wall_speedup']:.2f} faster "
                 "with jump-forward")
    lines.append(f"sample: {result['modes']['jump_forward_on']['sample_output']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF checkpoint dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON")
    args = parser.parse_args(argv)
    from ..engine import Engine

    def factory(**kw: Any) -> Engine:
        return Engine(args.model, device=args.device, **kw)

    result = run(factory, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
