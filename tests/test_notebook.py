"""rdkv.plots on tiny random models (fast, exact data checks) and the inspection notebook run headless."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama

pytest.importorskip("matplotlib")
from rdkv import plots  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "inspect_allocation.ipynb"
FIGURES = ("v_width_heatmap", "k_width_heatmap", "token_widths", "zone_sizes", "bytes_per_token", "rd_curve")


class Tok:
    """Stands in for a tokenizer: token i decodes to "<i>"."""

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def tiny():
    """One tiny Llama prefill (2 layers, 2 KV heads, head_dim 32, 120 tokens) compressed hard enough
    that tokens get evicted: (its record, the ids, the cache)."""
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    rec, _ = recorded(tiny_llama(), ids)
    cache = rdkv.compress(rec, 0.1, **SMALL)
    return rec, ids, cache


def test_v_width_heatmap_is_layers_by_positions_with_evictions_at_zero(tiny):
    _, ids, cache = tiny
    fig = plots.v_width_heatmap(cache, head=1)
    data = fig.axes[0].images[0].get_array()
    assert data.shape == (len(cache.layers), ids.shape[1])
    want = torch.stack([layer.v_widths()[0, 1] for layer in cache.layers])
    assert torch.equal(torch.as_tensor(data), want)
    assert (want == 0).any() and (want > 0).any()  # this budget evicts some tokens and keeps others


def test_positions_outside_a_sliding_window_are_not_held():
    rec, _ = recorded(tiny_gemma3(), torch.randint(0, 96, (1, 60)))
    cache = rdkv.compress(rec, 0.3, **SMALL)
    grid = plots.v_width_grid(cache)
    assert grid.shape == (3, 1, 60)
    for i, layer in enumerate(cache.layers):
        assert (grid[i, :, : layer.start] == plots.NOT_HELD).all()
        assert (grid[i, :, layer.start :] >= 0).all()
    assert cache.layers[0].start > 0 and cache.layers[2].start == 0
    plots.v_width_heatmap(cache)  # draws with the blank class


def test_k_width_heatmap_is_layers_by_channels(tiny):
    _, _, cache = tiny
    data = torch.as_tensor(plots.k_width_heatmap(cache, head=0).axes[0].images[0].get_array())
    assert data.shape == (len(cache.layers), 32)
    assert torch.equal(data, torch.stack([layer.k_widths()[0, 0] for layer in cache.layers]))


def test_token_widths_of_one_stream_labels_each_token_with_its_width(tiny):
    _, ids, cache = tiny
    fig = plots.token_widths(cache, Tok(), ids, layer=1, head=0, around=60, window=20)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    want = cache.layers[1].v_widths()[0, 0, 50:70]
    assert heights == want.tolist()
    labels = ax.get_xticklabels()
    assert [t.get_text() for t in labels] == [f"<{i}>" for i in ids[0, 50:70].tolist()]
    red = [t.get_color() == plots.WIDTH_COLORS[0] for t in labels]
    assert red == (want == 0).tolist()


def test_token_widths_over_all_streams_stacks_shares_and_clips_the_window(tiny):
    _, ids, cache = tiny
    fig = plots.token_widths(cache, Tok(), ids, around=118, window=10)  # clipped at the end
    ax = fig.axes[0]
    assert len(ax.get_xticklabels()) == 10
    tops = {}
    for p in ax.patches:  # one bar per (width, token): the shares of each token sum to 1
        tops[round(p.get_x(), 3)] = tops.get(round(p.get_x(), 3), 0) + p.get_height()
    assert len(tops) == 10 and all(abs(v - 1) < 1e-6 for v in tops.values())
    with pytest.raises(rdkv.RDKVError, match="prefill's ids"):
        plots.token_widths(cache, Tok(), ids[:, :50])


def test_locate_finds_the_token_where_a_text_starts():
    assert plots.locate(Tok(), [5, 17, 3], "17><3") == 1
    with pytest.raises(rdkv.RDKVError):
        plots.locate(Tok(), [5, 17, 3], "nowhere")


def test_zone_sizes_count_kept_rows_and_fresh_tokens(llama):
    rec, _ = recorded(llama, torch.randint(0, 96, (2, 80)))
    cache = rdkv.compress(rec, 0.2, **SMALL)
    llama(torch.randint(0, 96, (2, 3)), past_key_values=cache)  # 3 tokens into zone C
    top, bottom = plots.zone_sizes(cache).axes
    n = len(cache.layers)
    rows = [p.get_height() for p in top.patches]  # zone A bars of every layer, then zone B, then zone C
    for i, layer in enumerate(cache.layers):
        assert rows[i] + rows[n + i] == int(layer.kept.sum())
        assert rows[2 * n + i] == 2 * 2 * 3
    nbytes = [p.get_height() for p in bottom.patches]
    assert [sum(nbytes[i::n]) for i in range(n)] == [layer.nbytes for layer in cache.layers]


def test_bytes_per_token_stacks_every_byte_of_each_layer(tiny):
    _, ids, cache = tiny
    ax = plots.bytes_per_token(cache).axes[0]
    n = len(cache.layers)
    bars = [p.get_height() for p in ax.patches]
    assert len(bars) == n * len(plots.COMPONENTS)
    for i, layer in enumerate(cache.layers):
        assert sum(bars[i::n]) * ids.shape[1] == pytest.approx(layer.nbytes)


def test_rd_curve_is_the_solver_objective_and_the_chosen_cache_lies_on_it(tiny):
    rec, _, cache = tiny
    budgets = [0.1, 0.2, 0.5, 1.0]
    fig = plots.rd_curve(rec, budgets, chosen=cache, **SMALL)
    curve, star = fig.axes[0].lines[:2]
    assert list(curve.get_xdata()) == budgets
    d = list(curve.get_ydata())
    assert d[-1] < d[0]
    assert star.get_xdata()[0] == 0.1 and star.get_ydata()[0] == pytest.approx(d[0], rel=1e-9)
    assert star.get_ydata()[0] == pytest.approx(cache.distortion, rel=1e-9)  # the unit compress reports
    # compress after the curve is unchanged by it
    again = rdkv.compress(rec, 0.1, **SMALL)
    assert all(torch.equal(a.v_widths(), b.v_widths()) for a, b in zip(again.layers, cache.layers))
    at, _ = plots.modelled_distortion(rec, [1e-4], **SMALL)
    assert at[0] != at[0]  # a budget that cannot fit is NaN, not an error
    with pytest.raises(rdkv.RDKVError, match="needs a distortion model"):
        plots.modelled_distortion(rec, [0.5], method="snapkv")


def test_missing_matplotlib_names_the_extra(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(rdkv.RDKVError, match=r"pip install \.\[notebooks\]"):
        plots.zone_sizes(tiny[2])


def test_notebook_is_committed_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)


def _smollm2_available() -> bool:
    return ((rdkv.models.converted_dir("smollm2-135m") / "config.json").is_file()
            or importlib.util.find_spec(rdkv.models.MODELS["smollm2-135m"]["module"]) is not None)


@pytest.mark.skipif(not _smollm2_available(), reason="SmolLM2 weights are not installed (see rdkv.models)")
def test_notebook_runs_headless_and_draws_every_figure(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # a kernelspec of this very interpreter, first on JUPYTER_PATH, so no user or system "python3" kernel
    # (or a missing `ipykernel install`) decides which Python runs the notebook
    spec = tmp_path / "kernels" / "rdkv-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rdkv test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "TOKENS" in params[0].source
    params[0].source += "\nTOKENS = 500  # the test's shorter context: every cell runs, in half the time"
    nbclient.NotebookClient(nb, timeout=600, kernel_name="rdkv-test",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on any error
    figure_cells = [c for c in nb.cells if "figure" in c.metadata.get("tags", [])]
    for cell in figure_cells:
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.source
    for name in FIGURES:
        assert any(f"plots.{name}(" in c.source for c in figure_cells), name
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "full cache:" in text and "TriZoneCache (rdkv):" in text  # the report names what auto ran
