"""How often a JSON-constrained reply is valid JSON within max_tokens, by whitespace setting.

On the default model (SmolLM2-135M-Instruct, the shipped GGUF), offline `LLM.chat`
runs 50 varied JSON schemas (plus, with `--json-object`, the same prompts under
`response_format: json_object`) with `max_tokens` ~100, once per setting of
`--structured-outputs-config`:

- unbounded: `{"max_json_whitespace": null}`, llguidance's flexible whitespace
  `[ \\t\\r\\n]+` between tokens (what vLLM 0.33 and paged before the bound did);
- bounded: paged's default, one line break then at most 8 spaces or tabs;
- compact: `{"disable_any_whitespace": true}` (vLLM's key), no whitespace;
- bounded_closed: the bound plus `{"disable_additional_properties": true}` (vLLM's
  key: a schema's objects take no keys beyond their `properties`).

Half the prompts name the schema's fields, half are vague ("Output JSON.").
A reply counts as valid when `json.loads` accepts it. Also printed, per kind
(json_schema, json_object): how many replies stopped at max_tokens
(finish_reason "length"), how many hold a whitespace run of 10 or more
characters, and the mean share of whitespace characters. Sampling is seeded per request, so each
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
import re
import time
from typing import Any

SETTINGS: dict[str, dict[str, Any]] = {
    "unbounded": {"max_json_whitespace": None},
    "bounded": {},
    "compact": {"disable_any_whitespace": True},
    "bounded_closed": {"disable_additional_properties": True},
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


def prompt(i: int, subject: str, schema: dict[str, Any]) -> str:
    """Half the prompts name the fields; the other half are vague, as users often write.

    Vague prompts are where a small model pads JSON with runs of newlines.
    """
    if i % 2 == 0:
        return f"Describe {subject} as JSON with the fields {', '.join(schema['properties'])}."
    return _VAGUE[(i // 2) % len(_VAGUE)].format(subject=subject)


_VAGUE = [
    "Give me a JSON object about {subject}.",
    "Tell me about {subject}. Answer in JSON.",
    "JSON for {subject}, please.",
    "Output JSON.",
    "Hello! Can you describe {subject}?",
]


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
        kinds: list[str] = []
        for i, (subject, schema) in enumerate(cases):
            constraints = [StructuredOutputsParams(json=json.dumps(schema))]
            if args.json_object:
                constraints.append(StructuredOutputsParams(json_object=True))
            for so in constraints:
                conversations.append([{"role": "user", "content": prompt(i, subject, schema)}])
                kinds.append("json_schema" if so.json is not None else "json_object")
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
    by_kind: dict[str, dict[str, Any]] = {}
    for kind, out in zip(kinds, outputs, strict=True):
        row = by_kind.setdefault(
            kind,
            {"requests": 0, "valid_json": 0, "finished_by_length": 0, "whitespace_run_ge_10": 0},
        )
        completion = out.outputs[0]
        text = completion.text
        row["requests"] += 1
        try:
            json.loads(text)
            row["valid_json"] += 1
        except json.JSONDecodeError:
            row.setdefault("invalid_examples", [])
            if len(row["invalid_examples"]) < 2:
                row["invalid_examples"].append(text[:160])
        row["finished_by_length"] += completion.finish_reason == "length"
        longest = max((len(m) for m in re.findall(r"\s+", text)), default=0)
        row["whitespace_run_ge_10"] += longest >= 10
        row.setdefault("_ws", []).append(sum(c in " \t\r\n" for c in text) / max(1, len(text)))
    for row in by_kind.values():
        shares = row.pop("_ws")
        row["mean_whitespace_share"] = round(sum(shares) / len(shares), 3)
    return {
        "config": SETTINGS[name],
        "valid_json": sum(r["valid_json"] for r in by_kind.values()),
        "requests": len(outputs),
        "seconds": round(elapsed, 1),
        "by_kind": by_kind,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-object", action="store_true", help="also json_object prompts")
    parser.add_argument("--settings", default="unbounded,bounded,compact,bounded_closed")
    parser.add_argument(
        "--max-json-whitespace",
        type=int,
        default=None,
        help="the bound of the bounded settings (default: paged's default, 8)",
    )
    args = parser.parse_args()
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    if args.max_json_whitespace is not None:
        for key in ("bounded", "bounded_closed"):
            SETTINGS[key] = {**SETTINGS[key], "max_json_whitespace": args.max_json_whitespace}
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
