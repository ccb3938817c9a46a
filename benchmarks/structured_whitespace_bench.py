"""How often a JSON-constrained reply is valid JSON within max_tokens, by whitespace setting.

On the default model (SmolLM2-135M-Instruct, the shipped GGUF), offline `LLM.chat`
runs 50 varied JSON schemas (plus, with `--json-object`, the same prompts under
`response_format: json_object`) with `max_tokens` ~100, once per setting of
`--structured-outputs-config`:

- unbounded: `{"max_json_whitespace": null}`, llguidance's flexible whitespace
  `[ \\t\\r\\n]+` between tokens (what vLLM 0.33 and paged before the bound did);
- bounded: paged's default, one line break then at most 8 spaces or tabs;
- compact: `{"disable_any_whitespace": true}` (vLLM's key), no whitespace.

A reply counts as valid when `json.loads` accepts it. Also printed: how many
replies stopped at max_tokens (finish_reason "length"), and the mean share of
whitespace characters in the replies. Sampling is seeded per request, so each
setting sees the same random stream until the grammars' masks differ.

Run: .venvs/all/bin/python benchmarks/structured_whitespace_bench.py \\
         [--max-tokens 100] [--temperature 1.0] [--settings unbounded,bounded,compact]
Prints one JSON object.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import itertools
import json
import time
from typing import Any

SETTINGS: dict[str, dict[str, Any]] = {
    "unbounded": {"max_json_whitespace": None},
    "bounded": {},
    "compact": {"disable_any_whitespace": True},
}

_SUBJECTS = [
    "a book",
    "a city",
    "a user account",
    "a product",
    "a weather report",
    "a movie",
    "a recipe",
    "an employee",
    "a flight",
    "a song",
]
_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("name", {"type": "string"}),
    ("id", {"type": "integer"}),
    ("price", {"type": "number"}),
    ("active", {"type": "boolean"}),
    ("tags", {"type": "array", "items": {"type": "string"}, "maxItems": 4}),
    ("rating", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("status", {"enum": ["open", "closed", "pending"]}),
    ("year", {"type": "integer"}),
    (
        "address",
        {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
        },
    ),
    ("scores", {"type": "array", "items": {"type": "number"}, "maxItems": 3}),
    (
        "owner",
        {
            "type": "object",
            "properties": {"first": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["first"],
        },
    ),
    ("notes", {"type": "string", "maxLength": 40}),
]


def schemas(n: int) -> list[tuple[str, dict[str, Any]]]:
    """`n` (subject, schema) pairs: 2-5 fields each, a few nested objects and arrays."""
    out: list[tuple[str, dict[str, Any]]] = []
    combos = itertools.cycle(range(len(_FIELDS)))
    for i in range(n):
        size = 2 + i % 4
        picked: dict[str, dict[str, Any]] = {}
        while len(picked) < size:
            name, schema = _FIELDS[(next(combos) * 7 + i) % len(_FIELDS)]
            picked.setdefault(name, schema)
        required = list(picked)[: 1 + i % size]
        out.append(
            (
                _SUBJECTS[i % len(_SUBJECTS)],
                {"type": "object", "properties": picked, "required": required},
            )
        )
    return out


def run_setting(
    name: str, cases: list[tuple[str, dict[str, Any]]], args: argparse.Namespace
) -> dict[str, Any]:
    from paged.scheduler import SamplingParams, StructuredOutputsParams
    from paged.server import LLM

    llm = LLM(
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        structured_outputs_config=SETTINGS[name],
    )
    try:
        conversations = []
        params = []
        for i, (subject, schema) in enumerate(cases):
            constraints = [StructuredOutputsParams(json=json.dumps(schema))]
            if args.json_object:
                constraints.append(StructuredOutputsParams(json_object=True))
            for so in constraints:
                conversations.append(
                    [
                        {
                            "role": "user",
                            "content": f"Describe {subject} as JSON with the fields "
                            f"{', '.join(schema['properties'])}.",
                        }
                    ]
                )
                params.append(
                    SamplingParams(
                        max_tokens=args.max_tokens,
                        temperature=args.temperature,
                        seed=args.seed + i,
                        structured_outputs=so,
                    )
                )
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    valid = length = 0
    ws_share: list[float] = []
    examples: list[str] = []
    for out in outputs:
        completion = out.outputs[0]
        text = completion.text
        try:
            json.loads(text)
            valid += 1
        except json.JSONDecodeError:
            if len(examples) < 2:
                examples.append(text[:160])
        length += completion.finish_reason == "length"
        ws_share.append(sum(c in " \t\r\n" for c in text) / max(1, len(text)))
    return {
        "config": SETTINGS[name],
        "requests": len(outputs),
        "valid_json": valid,
        "finished_by_length": length,
        "mean_whitespace_share": round(sum(ws_share) / len(ws_share), 3),
        "seconds": round(elapsed, 1),
        "invalid_examples": examples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-object", action="store_true", help="also json_object prompts")
    parser.add_argument("--settings", default="unbounded,bounded,compact")
    args = parser.parse_args()
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    cases = schemas(args.schemas)
    results = {name: run_setting(name, cases, args) for name in names}
    print(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct (default GGUF)",
                "schemas": args.schemas,
                "json_object": args.json_object,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
