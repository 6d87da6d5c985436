"""Rebuild kjv.jsonl.gz from Debian's `bible-kjv` package (how the bundled corpus was made).

    apt-get install bible-kjv && python data_prep/corpus/build_kjv.py

One JSON line per chapter: {"text": "Genesis 1\n\nIn the beginning ...", "book": "Genesis", "chapter": 1}.
Verse numbers are dropped; the wrapped lines of a verse are joined.
"""

import gzip
import json
import re
import subprocess
from pathlib import Path

HEADER = re.compile(r"^(\S.*) (\d+)$")
VERSE = re.compile(r"^\s+\d+ (.*)$")


def chapters(raw: str):
    book, chapter, verses = None, None, []
    for line in raw.splitlines():
        if not line.strip():
            continue
        if m := HEADER.match(line):
            if verses:
                yield book, chapter, verses
            book, chapter, verses = m.group(1), int(m.group(2)), []
        elif m := VERSE.match(line):
            verses.append(m.group(1).strip())
        else:  # continuation of a wrapped verse
            verses[-1] += " " + line.strip()
    if verses:
        yield book, chapter, verses


def main():
    raw = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    out = Path(__file__).with_name("kjv.jsonl.gz")
    with gzip.GzipFile(out, "wb", mtime=0) as f:
        for book, chapter, verses in chapters(raw):
            text = f"{book} {chapter}\n\n" + "\n".join(verses)
            f.write((json.dumps({"text": text, "book": book, "chapter": chapter}) + "\n").encode())


if __name__ == "__main__":
    main()
