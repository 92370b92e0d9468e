"""Every notebook in ``notebooks/`` runs top to bottom, at a small size, so a broken one fails CI.

Each notebook is executed with nbclient in a fresh ``python3`` kernel (ipykernel, the
interpreter running the tests) started in the repository root, with ``PYTHONPATH`` pointing
there too, so it imports this checkout's ``thor_optax``. The environment asks for a small run
(``THOR_OPTAX_NOTEBOOK_STEPS``) and the Agg matplotlib backend (``plt.show()`` draws nothing).
A notebook fails the test if any cell raises, or if its final ``RESULT`` lines are missing or
report a poor result: ``RESULT <optimizer> final_accuracy=<x>`` (the MNIST notebooks) below
``ACCURACY_FLOOR``, or ``RESULT <optimizer> final_val_bpc=<x>`` (the language-model notebook:
validation loss in bits per character) above ``BPC_CEILING``. The notebooks are found by glob,
so a new one is covered without editing this file.

The saved notebooks are also checked: valid nbformat 4, no outputs, an "Open in Colab" badge
to their own path at the top, and an entry in ``notebooks/README.md``.
"""

from __future__ import annotations

import os
import pathlib
import re
import time

import nbformat
from nbclient import NotebookClient
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
IDS = [path.stem for path in NOTEBOOKS]

# Training steps per optimizer under test (a notebook's default is a real run of 300).
SMALL_STEPS = "30"
# Every notebook trains MNIST digits past this test accuracy in SMALL_STEPS steps (chance: 0.1;
# measured at 30 steps: 0.72-0.93).
ACCURACY_FLOOR = 0.5
# The language-model notebook (transformer_lm) reaches at most this validation loss, in bits per
# character, in SMALL_STEPS steps (a uniform prediction over its 99 characters: 6.63; at the
# initialization: 7.76; measured at 30 steps on CPython 3.11: THOR 4.35, AdamW 4.44).
BPC_CEILING = 4.8
CELL_TIMEOUT_S = 600

COLAB = "https://colab.research.google.com/github/thor-optax/thor_optax/blob/main/notebooks/"
RESULT = re.compile(r"^RESULT (\S+) final_(accuracy|val_bpc)=(\S+)", re.M)


def _stream_text(nb) -> str:
  return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.get("outputs", []) if out.get("output_type") == "stream")


def test_notebooks_exist():
  names = {path.name for path in NOTEBOOKS}
  assert {"quickstart.ipynb", "trace_mask.ipynb", "nnx.ipynb", "transformer_lm.ipynb"} <= names, (
      names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_saved_clean(path):
  """Valid nbformat 4, saved without outputs, with its own Colab badge and a README entry."""
  nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
  assert nb.nbformat == 4
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, (
          f"{path.name}: save the notebook with its outputs cleared")
  assert nb.cells[0].cell_type == "markdown" and COLAB + path.name in nb.cells[0].source
  assert COLAB + path.name in (NOTEBOOK_DIR / "README.md").read_text()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("THOR_OPTAX_NOTEBOOK_STEPS", SMALL_STEPS)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
  # A user's kernel sees one CPU device: drop the 4 host devices conftest.py sets for the
  # sharding tests.
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", ""))
  monkeypatch.setenv("XLA_FLAGS", flags.strip())
  # XLA's cheaper optimization levels (as the fast_compiles fixture): at SMALL_STEPS the kernel
  # spends most of its time compiling; measured on 2 cores: quickstart + transformer_lm 95 s ->
  # 85 s.
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                          resources={"metadata": {"path": str(REPO)}})
  start = time.perf_counter()
  client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
  print(f"{path.name}: executed in {time.perf_counter() - start:.1f} s")

  text = _stream_text(nb)
  results = RESULT.findall(text)
  assert results, (f"{path.name} printed no 'RESULT <name> final_accuracy=<x>' or 'RESULT "
                   f"<name> final_val_bpc=<x>' line:\n{text}")
  for name, metric, value in results:
    check_result(path.name, name, metric, float(value))


def check_result(notebook: str, name: str, metric: str, value: float) -> None:
  """Fails unless one ``RESULT`` line reports a good enough result (NaN fails too)."""
  if metric == "accuracy":
    assert value >= ACCURACY_FLOOR, (
        f"{notebook}: {name} reached test accuracy {value} < {ACCURACY_FLOOR}")
  else:
    assert value <= BPC_CEILING, (
        f"{notebook}: {name} reached validation loss {value} bits per character > "
        f"{BPC_CEILING}")


@pytest.mark.parametrize("metric,value,passes", [
    ("accuracy", 0.9, True), ("accuracy", 0.1, False), ("accuracy", float("nan"), False),
    ("val_bpc", 3.0, True), ("val_bpc", 6.6, False), ("val_bpc", float("nan"), False)])
def test_result_check_can_fail(metric, value, passes):
  """The RESULT check rejects poor results and NaN, for both kinds of notebook."""
  line = f"RESULT THOR final_{metric}={value}"
  (name, parsed_metric, parsed), = RESULT.findall(line)
  if passes:
    check_result("x.ipynb", name, parsed_metric, float(parsed))
  else:
    with pytest.raises(AssertionError):
      check_result("x.ipynb", name, parsed_metric, float(parsed))
