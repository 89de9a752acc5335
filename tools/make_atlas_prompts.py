"""Write the bundled demo model's atlas prompt set, colibri_core/atlas_prompts/kjv.json: passages of
the King James Bible (public domain; Debian's `bible-kjv-text`, as tools/train_demo.py reads it),
eight per genre, the topics being the genres of its books.

    apt-get install bible-kjv-text
    python tools/make_atlas_prompts.py colibri_core/atlas_prompts/kjv.json

Deterministic: the passages are named below. tests/test_atlas.py holds out other passages of the
same genres to check that the profiles the atlas measures are not noise.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

PASSAGES = {
    "law": ["Gen1:1-3", "Gen12:1-3", "Ex20:1-4", "Ex21:1-4", "Lev11:1-4", "Lev19:9-12", "Num1:1-3", "Deut6:4-7"],
    "history": ["Josh1:1-3", "Judg2:11-13", "1Sam17:4-7", "2Sam11:1-3", "1Kings3:16-19", "2Kings2:11-13",
                "Ezra1:1-3", "Neh2:1-3"],
    "poetry": ["Job38:1-4", "Ps23:1-4", "Ps91:1-4", "Prov3:5-8", "Eccl1:2-5", "Song2:10-13", "Ps1:1-3",
               "Prov31:10-13"],
    "prophecy": ["Isa40:1-4", "Jer1:4-7", "Ezek37:1-4", "Dan7:1-3", "Hos11:1-3", "Amos5:21-24", "Mic6:6-8",
                 "Mal3:1-3"],
    "gospels": ["Matt5:3-7", "Mark1:1-4", "Luke2:8-11", "John1:1-5", "Matt6:9-13", "Luke15:11-14", "John3:16-18",
                "Mark4:3-6"],
    "letters": ["Rom8:28-31", "1Cor13:4-7", "Gal5:22-25", "Eph6:10-13", "Phil4:4-7", "Heb11:1-3", "Jas1:2-5",
                "1John4:7-9"],
}


def passage(ref: str) -> str:
    """The text of `ref` (e.g. "Ps23:1-4"), verse references stripped, one verse a line."""
    try:
        out = subprocess.run(["bible", "-f", ref], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        sys.exit("the passages need Debian's bible-kjv-text: apt-get install bible-kjv-text")
    return "\n".join(re.sub(r"^\S+\d+:\d+ ", "", line).strip() for line in out.splitlines() if line.strip())


def main() -> None:
    out = Path(sys.argv[1])
    prompts = [{"topic": genre, "text": passage(ref), "source": f"King James Bible (public domain), {ref}"}
               for genre, refs in PASSAGES.items() for ref in refs]
    doc = {"name": "kjv-genres", "about": "The demo model's atlas prompts: King James Bible passages by the genre "
           "of their book (tools/make_atlas_prompts.py).", "prompts": prompts}
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
