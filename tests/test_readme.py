"""The README's API example runs as written (on CPU it takes the reference) and its merge
of two key halves equals attention over all keys."""

import pathlib
import re


def test_readme_example_runs(capsys):
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"```python\n(import torch\nimport wsattn.*?)```", text, re.S)
    assert block, "README has no runnable API example"
    exec(compile(block.group(1), "README.md", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert float(printed[-1]) < 1e-3, f"merged halves differ from full attention by {printed[-1]}"
