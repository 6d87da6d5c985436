"""eval/tasks/kjv_cloze: lm's offline lm-eval task. Its shipped data is what utils.py builds from the bundled corpus,
each item's answer is the verse's own ending, and lm-eval loads it with nothing but the task folder (no hub, no
datasets cache, any working directory). tests/wheel_check.sh runs it from the installed wheel."""

import importlib.util
import json

from lm.util.resources import shipped

FOLDER = shipped("eval/tasks/kjv_cloze")


def task_utils():
    # lm-eval loads a task folder's utils.py by path (`!function utils.load`), and so does this test.
    spec = importlib.util.spec_from_file_location("kjv_cloze_utils", FOLDER / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    return utils


def test_the_shipped_items_are_what_utils_builds_from_the_bundled_corpus():
    utils = task_utils()
    shipped_rows = [json.loads(line) for line in (FOLDER / "kjv_cloze.jsonl").read_text().splitlines()]
    assert shipped_rows == utils.build()
    verses = set(utils.verses())
    assert len(shipped_rows) == utils.ITEMS
    for i, row in enumerate(shipped_rows):
        assert row["answer"] == i % utils.CHOICES and len(set(row["choices"])) == utils.CHOICES
        assert row["context"] + row["choices"][row["answer"]] in verses


def test_lm_eval_loads_the_task_offline_from_another_directory(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager, get_task_dict

    monkeypatch.chdir(tmp_path)
    manager = TaskManager(include_path=str(shipped("eval/tasks")), include_defaults=False)
    task = get_task_dict(["kjv_cloze"], manager)["kjv_cloze"]
    docs = list(task.test_docs())
    assert len(docs) == 40
    assert task.doc_to_choice(docs[0])[task.doc_to_target(docs[0])] == docs[0]["choices"][docs[0]["answer"]]
