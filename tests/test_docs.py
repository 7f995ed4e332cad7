"""The docs cannot drift: the configuration reference is what the models say, and every
file the README links to exists."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_generated_from_the_models():
    render = runpy.run_path(str(REPO / "scripts" / "gen_config_docs.py"))["render"]
    text = render()
    assert (REPO / "docs" / "configuration.md").read_text() == text, (
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    )
    # Spot checks against conf/config.yaml and the models, so that an empty render fails.
    assert "| `pcp` | int | `2` | prefill context parallel size (PCP ranks) |" in text
    assert "### `workload=explicit`" in text and "| `workload.prompt_lens` |" in text
    assert "### draft: `mtp`" in text and "| `draft.num_speculative_tokens` |" in text
    assert "num_speculative_tokens` | int | `0`" not in text  # derived: not a setting


def test_the_readme_links_and_examples_exist():
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert links and all((REPO / link).is_file() for link in links), links
    for module in re.findall(r"plugins=\[([\w.]+)\] ", readme):
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module
