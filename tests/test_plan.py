"""Plan schema: each invalid plan is rejected with one message naming the field; valid plans round-trip."""
import copy

import pytest
import yaml

from hrlplan.cluster import ClusterSpec, DeviceInfo
from hrlplan.plan import Plan, PlanError, check_fits, homogeneous_plan


def good():
    return homogeneous_plan("gpt2-tiny", 6, [(0, 4), (4, 6)], dp=2, tp=1, microbatch_size=1, num_microbatches=4,
                            schedule="1f1b")


def mutate(fn):
    d = copy.deepcopy(good().to_dict())
    fn(d)
    return d


def test_round_trip_through_yaml(tmp_path):
    plan = good()
    plan.save(tmp_path / "plan.yaml")
    again = Plan.load(tmp_path / "plan.yaml")
    assert again == plan
    assert again.layout() == "E+h0-h3 | h4-h5+H"


CASES = {
    "overlapping layers": (lambda d: d["stages"][1].update(layers=[3, 6]), "stages[1].layers", "block 3"),
    "uncovered layers": (lambda d: d["stages"][1].update(layers=[4, 5]), "stages", "blocks 5 are not covered"),
    "layers outside model": (lambda d: d["stages"][1].update(layers=[4, 9]), "stages[1].layers", "outside"),
    "embedding not first": (lambda d: (d["stages"][0].update(embedding=False), d["stages"][1].update(embedding=True)),
                            "stages[1].embedding", "first stage"),
    "head not last": (lambda d: d["stages"][0].update(head=True), "stages[0].head", "last stage"),
    "ranks != world size": (lambda d: d.update(world_size=8), "world_size", "world_size is 8"),
    "microbatches not dividing": (lambda d: d.update(global_batch_size=10), "num_microbatches", "global batch 10"),
    "fewer microbatches than stages": (lambda d: d.update(num_microbatches=1, global_batch_size=2),
                                       "num_microbatches", "fewer than the 2 pipeline stages"),
    "non-uniform nproc-per-node": (lambda d: d["meta"]["launch"].update(
        nnodes=2, nproc_per_node=2, per_node_visible_devices=["0,1,2", "0"]), "meta.launch.per_node_visible_devices",
        "same --nproc-per-node"),
    "unknown schedule": (lambda d: d.update(schedule="pipedream"), "schedule", "unknown schedule 'pipedream'"),
    "missing key": (lambda d: d.pop("pp"), "pp", "missing"),
    "unknown key": (lambda d: d.update(ppp=2), "ppp", "unknown key"),
    "tp*dp != ranks": (lambda d: d["stages"][0].update(tp=2), "stages[0].ranks", "tp*dp"),
    "unequal groups": (lambda d: d["device_groups"][1].append(0), "device_groups", "equal size"),
    "string tp": (lambda d: d["stages"][0].update(tp="2"), "stages[0].tp", "must be an integer, got '2'"),
    "word tp": (lambda d: d["stages"][1].update(tp="two"), "stages[1].tp", "must be an integer, got 'two'"),
    "float dp": (lambda d: d["stages"][0].update(dp=2.0), "stages[0].dp", "must be an integer, got 2.0"),
    "string ranks": (lambda d: d["stages"][0].update(ranks="0,1"), "stages[0].ranks", "list of integer ranks"),
    "string head": (lambda d: d["stages"][1].update(head="yes"), "stages[1].head", "true or false"),
    "unknown recompute": (lambda d: d["stages"][1].update(recompute="partial"), "stages[1].recompute",
                          "unknown mode 'partial'; choose one of none, selective, full"),
    "stage on a rank beyond world size": (lambda d: (d["stages"][1].update(ranks=[d["world_size"] + 3]),
                                                     d["device_groups"][1].__setitem__(0, d["world_size"] + 3)),
                                          "stages[1].ranks", "is beyond world_size"),
    "idle rank beyond world size": (lambda d: d.update(unused_ranks=[99]), "unused_ranks", "rank 99 is beyond"),
    "string device group": (lambda d: d.update(device_groups="0,1"), "device_groups", "lists of integer ranks"),
    "unknown replica optimizer": (lambda d: d["meta"].update(replica_optimizer="zero3"), "meta.replica_optimizer",
                                  "'zero3' is not one of sharded, replicated"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_plan_names_the_field(case):
    fn, field, words = CASES[case]
    with pytest.raises(PlanError) as e:
        Plan.from_yaml(yaml.safe_dump(mutate(fn)))
    assert e.value.field == field, str(e.value)
    assert words in str(e.value)
    assert str(e.value).startswith("plan.yaml: ")


def _cluster(n, mem):
    return ClusterSpec(name="t", devices=[DeviceInfo(rank=r, node=0, local_rank=r, hostname="h", kind="cuda",
                                                     name="GPU", memory_bytes=mem, peak_flops=1e12) for r in range(n)],
                       intra_node_bw=[1e9], source="probe")


def test_memory_over_device_is_rejected_with_rank():
    plan = good()
    plan.meta["predicted"] = {"memory_bytes_per_rank": [1 * 2**30, 1 * 2**30, 5 * 2**30, 1 * 2**30]}
    with pytest.raises(PlanError, match=r"rank 2 \(GPU\) is predicted to need 5.00 GiB but has 4.00 GiB"):
        check_fits(plan, _cluster(4, 4 * 2**30))


def test_world_size_mismatch_names_both_numbers():
    with pytest.raises(PlanError, match="needs 4 ranks but the job has 2"):
        check_fits(good(), _cluster(2, 2**34))


def test_malformed_yaml_and_missing_file(tmp_path):
    with pytest.raises(PlanError, match="not valid YAML"):
        Plan.from_yaml("pp: [1, 2")
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "nope.yaml")


def test_every_plan_load_has_the_yaml_budget(tmp_path):
    from hrlplan.validate import MAX_YAML_BYTES

    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
    with pytest.raises(PlanError, match="plan.yaml: <file>: expands to .* YAML aliases"):
        Plan.from_yaml(laughs + yaml.safe_dump(good().to_dict()))
    (tmp_path / "huge.yaml").write_text("#" * (MAX_YAML_BYTES + 1))
    with pytest.raises(PlanError, match=r"huge.yaml: <file>: is .* MiB; .* at most"):
        Plan.load(tmp_path / "huge.yaml")
    with pytest.raises(PlanError) as e:
        Plan.from_yaml("model: [unclosed\n  - : :")
    assert "\n" not in str(e.value) and "not valid YAML" in str(e.value)


def test_preset_plan_may_use_a_subset_through_rank_to_device():
    plan = good()
    plan.meta["launch"]["rank_to_device"] = [4, 5, 6, 7]
    plan.meta["predicted"] = {"memory_bytes_per_rank": [2**30] * 4}
    preset = _cluster(8, 2**34)
    preset.source = "preset"
    check_fits(plan, preset)
    plan.meta["launch"]["rank_to_device"] = [5, 6, 7, 8]
    with pytest.raises(PlanError, match="does not have"):
        check_fits(plan, preset)


def test_recompute_is_per_stage_defaults_to_none_and_round_trips(tmp_path):
    plan = good()
    assert [s.recompute for s in plan.stages] == ["none", "none"]
    assert "recompute" not in plan.to_yaml()      # plans without recomputation read as they always did
    d = copy.deepcopy(plan.to_dict())
    d["stages"][0]["recompute"] = "full"
    again = Plan.from_yaml(yaml.safe_dump(d))
    assert [s.recompute for s in again.stages] == ["full", "none"]
    again.save(tmp_path / "plan.yaml")
    assert Plan.load(tmp_path / "plan.yaml") == again
    assert [s.recompute for s in again.as_pipelines()[1].stages] == ["full", "none"]
    built = homogeneous_plan("gpt2-tiny", 6, [(0, 4), (4, 6)], dp=1, tp=1, microbatch_size=1, num_microbatches=2,
                             schedule="1f1b", recompute=["selective", "full"])
    assert [s.recompute for s in built.stages] == ["selective", "full"]
    with pytest.raises(PlanError, match="1 recompute modes for 2 stages"):
        homogeneous_plan("gpt2-tiny", 6, [(0, 4), (4, 6)], dp=1, tp=1, microbatch_size=1, num_microbatches=2,
                         schedule="1f1b", recompute=["full"])


def test_loading_a_directory_or_binary_names_the_file(tmp_path):
    good().save(tmp_path / "plan.yaml")
    with pytest.raises(PlanError, match="is a directory, not a plan file .it holds a plan.yaml"):
        Plan.load(tmp_path)
    (tmp_path / "garbage.yaml").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(PlanError) as e:
        Plan.load(tmp_path / "garbage.yaml")
    assert str(e.value).startswith(str(tmp_path / "garbage.yaml"))


def test_virtual_stages_are_placed_by_the_schedule_registry():
    """stage_to_group asks hrlplan.schedules (V for the zero-bubble V schedule, looped otherwise);
    an unknown schedule is a PlanError naming the field."""
    from hrlplan.plan import stage_to_group

    assert [stage_to_group(k, 4, 2, "zero_bubble") for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_to_group(k, 4, 2, "interleaved_1f1b") for k in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_to_group(k, 3, 1, "1f1b") for k in range(3)] == [0, 1, 2]
    with pytest.raises(PlanError, match=r"schedule: unknown schedule 'looped'"):
        stage_to_group(1, 2, 2, "looped")
