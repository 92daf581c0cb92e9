"""lm-evaluation-harness both ways: an export read by `--model hf` and the same run served by `nanollama4 serve`
read by `--model local-completions` score the same items alike. Called by benchmarks/lm_eval.sh.

    .venv/bin/python benchmarks/lm_eval_check.py tasks DIR TEXT     write two local tasks (no download) into DIR
    .venv/bin/python benchmarks/lm_eval_check.py compare HF_OUT API_OUT TASKS_DIR EXPORT

The tasks, built from TEXT (held-out text): `nanollama4_next_line`, multiple choice, a line and four
candidates for the line after it (the true one and three others from the text); `nanollama4_rolling`, the
log-likelihood of whole passages in rolling windows (`loglikelihood_rolling`, which starts each passage after
the model's prefix token: its EOS). `compare` reads both runs' per-item samples and prints a table: items,
accuracy each way, and the largest difference of a log-likelihood: per item for the multiple choice (a
continuation of a few dozen tokens), per token for the passages (a sum over hundreds of tokens, computed in
float32 in a different order by transformers and by us).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

LINES, PASSAGES = 200, 20


def write_tasks(folder: Path, text_file: Path) -> None:
    text = text_file.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if 20 < len(line.strip()) and len(line) < 60]  # fits any context
    rng = random.Random(0)
    items = []
    for i in rng.sample(range(len(lines) - 1), LINES):
        others = rng.sample([j for j in range(len(lines)) if j not in (i, i + 1)], 3)
        choices = [lines[i + 1], *(lines[j] for j in others)]
        rng.shuffle(choices)
        items.append({"context": lines[i] + "\n", "choices": choices, "answer": choices.index(lines[i + 1])})
    passages = [p for p in text.split("\n\n") if len(p) > 400][:PASSAGES]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "next_line.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    (folder / "rolling.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in passages), encoding="utf-8")
    (folder / "next_line.yaml").write_text(f"""task: nanollama4_next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'next_line.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""", encoding="utf-8")
    (folder / "rolling.yaml").write_text(f"""task: nanollama4_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'rolling.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""", encoding="utf-8")


def _samples(out: Path, task: str) -> dict[int, list[float]]:
    """Per item (doc_id), its log-likelihoods as lm-eval logged them (samples_TASK_*.jsonl under OUT)."""
    found = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not found:
        raise SystemExit(f"no samples of {task} under {out}")
    items = {}
    for line in found[-1].read_text().splitlines():
        doc = json.loads(line)
        items[doc["doc_id"]] = [float(r[0][0] if isinstance(r[0], list) else r[0]) for r in doc["resps"]]
    return items


def _accuracy(out: Path, task: str) -> float | None:
    results = sorted(out.rglob("results_*.json"))
    got = json.loads(results[-1].read_text())["results"].get(task, {})
    return got.get("acc,none", got.get("word_perplexity,none"))


def compare(hf_out: Path, api_out: Path, tasks: Path, export: Path) -> int:
    from nanollama4.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(export / "tokenizer.json")
    passages = [json.loads(line)["text"] for line in (tasks / "rolling.jsonl").read_text().splitlines()]
    per = {"nanollama4_next_line": lambda k: 1,
           "nanollama4_rolling": lambda k: len(tokenizer.encode(passages[k]))}
    print("| task | items | hf | local-completions (serve) | largest log-likelihood difference |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for task, unit in (("nanollama4_next_line", "an item"), ("nanollama4_rolling", "a token")):
        a, b = _samples(hf_out, task), _samples(api_out, task)
        assert a.keys() == b.keys(), (task, len(a), len(b))
        diff = max(abs(x - y) / per[task](k) for k in a for x, y in zip(a[k], b[k], strict=True))
        worst = max(worst, diff)
        print(f"| {task} | {len(a)} | {_accuracy(hf_out, task):.4f} | {_accuracy(api_out, task):.4f} | "
              f"{diff:.2e} {unit} |")
    print(f"\nlog-likelihoods {'agree' if worst < 1e-4 else 'DIFFER'} to 1e-4 (largest {worst:.2e})")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    if sys.argv[1] == "tasks":
        write_tasks(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(compare(*map(Path, sys.argv[2:6])))
