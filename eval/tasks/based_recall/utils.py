"""The in-context TriviaQA, NQ and DROP of the Based paper (Arora et al. 2024): the passage that holds the answer
is in the prompt, followed by the question; the model generates up to a newline and scores if its text contains
any gold answer (case-insensitive). lm-eval's stock triviaqa / nq_open / drop are closed-book instead."""

import re

MARKUP = re.compile(r"\[(PAR|DOC|TLE)\]")  # TriviaQA's paragraph / document / title tags


def doc_to_text(doc: dict) -> str:
    context = MARKUP.sub("", doc["context"]).strip()
    question = doc["question"].strip()
    while question and context.lower().endswith(question.lower()):  # some passages end with the question
        context = context[: -len(question)].rstrip()
    return context.strip(".") + ". " + question


def process_results(doc: dict, results: list[str]) -> dict:
    output = results[0].lower()
    return {"contains": float(any(answer.lower() in output for answer in doc["answers"] if answer.strip()))}
