"""Every form in which torch and DeepSpeed record a collective, sized by the op's schema (synthetic traces)."""

from __future__ import annotations

from test_traces import GLOO, _x, write_trace

from shardscope.profiling import traces


def _analyse(tmp_path, events, world=2, pg_sizes=None):
    path = write_trace(tmp_path / "rank0.trace.json", [_x("ProfilerStep#1", 0, 10_000, cat="user_annotation")] + events,
                       world=world)
    if pg_sizes is not None:  # torch writes the process groups into distributedInfo
        import json

        doc = json.loads(path.read_text())
        doc["distributedInfo"]["pg_config"] = [{"pg_name": str(i), "pg_size": n} for i, n in enumerate(pg_sizes)]
        path.write_text(json.dumps(doc, indent=2))
    return traces.analyse_rank(traces.load_rank_trace(str(path)))["collectives"]


def _gloo(name, ts, dims, dtype="float"):
    return _x(f"gloo:{name}", ts, 10, cat="user_annotation", tid=GLOO, args={"Input Dims": dims, "Input type": [dtype]})


def test_tensor_list_all_gather_without_outputs_is_input_times_group(tmp_path):
    """FSDP1 on gloo: ``c10d::allgather_`` records its Tensor[][] outputs as [] (torch 2.13)."""
    events = [_x("c10d::allgather_", 10, 5, args={"Input Dims": [[], [[16416]], [], [], []],
                                                   "Input type": ["", "TensorList", "", "Scalar", "Scalar"]}),
              _gloo("all_gather", 20, [[16416]])]
    ag = _analyse(tmp_path, events, pg_sizes=[2])["all_gather"]
    assert (ag["bytes_per_step"], ag["group_size"], ag["dtype"]) == (16416 * 2 * 4, 2, "float")


def test_ambiguous_group_gives_unknown_with_the_op_name_never_zero(tmp_path):
    events = [_x("c10d::allgather_", 10, 5, args={"Input Dims": [[], [[100]], [], [], []],
                                                   "Input type": ["", "TensorList", "", "Scalar", "Scalar"]}),
              _gloo("all_gather", 20, [[100]])]
    ag = _analyse(tmp_path, events, world=4, pg_sizes=[4, 2, 2])["all_gather"]
    assert ag["bytes_per_step"] is None and ag["count_per_step"] == 1
    assert list(ag["unknown_ops"]) == ["c10d::allgather_: output shapes not recorded and the group size is ambiguous"]


def test_base_and_coalesced_ops(tmp_path):
    events = [
        _x("c10d::_allgather_base_", 10, 5, args={"Input Dims": [[800], [200], [], [], []],
                                                  "Input type": ["c10::BFloat16", "c10::BFloat16", "", "Scalar", "Scalar"]}),
        _gloo("all_gather", 20, [[200]], "c10::BFloat16"),
        _x("c10d::allgather_into_tensor_coalesced_", 100, 5, args={"Input Dims": [[[400], [80]], [[100], [20]], [], []],
                                                                   "Input type": ["TensorList", "TensorList", "", "Scalar"]}),
        _gloo("all_gather", 110, [[100]]),
        _x("c10d::reduce_scatter_tensor_coalesced_", 200, 5, args={"Input Dims": [[[100]], [[400]], [], [], [], []],
                                                                   "Input type": ["TensorList", "TensorList", "", "", "Scalar", "Scalar"]}),
        _gloo("all_reduce", 210, [[400]]),
        _x("c10d::allreduce_coalesced_", 300, 5, args={"Input Dims": [[[3], [5]], [], [], [], []],
                                                       "Input type": ["TensorList", "", "", "Scalar", "Scalar"]}),
        _gloo("all_reduce", 310, [[8]]),
    ]
    got = _analyse(tmp_path, events, world=4)
    assert got["all_gather"]["bytes_per_step"] == 800 * 2 + 480 * 4
    assert got["reduce_scatter"]["bytes_per_step"] == 400 * 4
    assert got["all_reduce"]["bytes_per_step"] == 8 * 4


def test_record_param_comms_inside_a_c10d_op_is_one_collective(tmp_path):
    events = [_x("c10d::_allgather_base_", 10, 50, args={"Input Dims": [[800], [200], [], [], []],
                                                         "Input type": ["float", "float", "", "Scalar", "Scalar"]}),
              _x("record_param_comms", 12, 20, args={"Collective name": "_allgather_base", "dtype": "BFloat16",
                                                     "In msg nelems": 200, "Out msg nelems": 800, "Group size": 4}),
              _x("c10d::allreduce_", 100, 30, args={"Input Dims": [[[10]], [], [], [], [], []],
                                                    "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]})]
    got = _analyse(tmp_path, events, world=4)
    assert got["all_gather"]["count_per_step"] == 1 and got["all_gather"]["bytes_per_step"] == 1600
    # a c10d op without record_param_comms (gloo) is still read; no execution gave its dtype
    assert got["all_reduce"]["bytes_per_step"] is None
    assert "c10d::allreduce_: dtype not recorded" in got["all_reduce"]["unknown_ops"]


def test_functional_collective_wrapping_a_c10d_op_and_nested_repeats_count_once(tmp_path):
    events = [_x("_c10d_functional::all_reduce", 10, 50, args={"Input Dims": [[26], [], []], "Input type": ["float", "", ""]}),
              _x("c10d::allreduce_", 12, 40, args={"Input Dims": [[[26]], [], [], [], [], []],
                                                   "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]}),
              _x("c10d::allreduce_", 14, 30, args={"Input Dims": [[[26]], [], [], [], [], []],
                                                   "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]}),
              _gloo("all_reduce", 20, [[26]]),
              _x("_c10d_functional::wait_tensor", 70, 5, args={"Input Dims": [[26]], "Input type": ["float"]})]
    ar = _analyse(tmp_path, events)["all_reduce"]
    assert ar["count_per_step"] == 1 and ar["bytes_per_step"] == 26 * 4


def test_functional_collective_alone_is_read(tmp_path):
    events = [_x("_c10d_functional::reduce_scatter_tensor", 10, 50,
                 args={"Input Dims": [[64], [], [], []], "Input type": ["c10::BFloat16", "", "", ""]})]
    assert _analyse(tmp_path, events)["reduce_scatter"]["bytes_per_step"] == 128


def test_collectives_inside_the_instrument_span_are_left_out(tmp_path):
    events = [_x("shardscope::instrument", 100, 100, cat="user_annotation"),
              _x("c10d::allreduce_", 120, 30, args={"Input Dims": [[[10]], [], [], [], [], []],
                                                    "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]}),
              _gloo("all_reduce", 130, [[10]]),
              _x("c10d::broadcast_", 300, 10, args={"Input Dims": [[[4]], [], [], [], [], []],
                                                    "Input type": ["TensorList", "", "", "", "", ""]}),
              _gloo("broadcast", 305, [[4]])]
    path = write_trace(tmp_path / "rank0.trace.json", [_x("ProfilerStep#1", 0, 10_000, cat="user_annotation")] + events)
    out = traces.analyse_rank(traces.load_rank_trace(str(path)))
    assert list(out["collectives"]) == ["broadcast"] and out["instrument_collectives_per_step"] == 1
    assert out["comm_bytes_per_step"] == 16
