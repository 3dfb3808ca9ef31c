"""The multi-task network: output contract per preset, gradients, losses, export-readiness."""

import warnings

import pytest
import torch

from stack.config import load_pipeline
from stack.models import build_model
from stack.models.outputs import OUTPUTS, output_layout, output_names, output_shapes
from stack.synthetic_batch import random_batch

from helpers import device_params, fixed_and_per_batch_outputs

warnings.filterwarnings("ignore", message="bev_pool: the extension")
PRESETS = {"default": ["configs/pipeline.yaml"],
           "tiny": ["configs/pipeline.yaml", "configs/presets/tiny.yaml"],
           "large": ["configs/pipeline.yaml", "configs/presets/large.yaml"]}


def pipeline(preset="tiny", *overrides):
    return load_pipeline(PRESETS[preset], list(overrides))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    p = pipeline("tiny")
    return p, build_model(p), random_batch(p, batch_size=2, seed=0)


def test_tiny_outputs_match_the_documented_layout(tiny):
    p, model, batch = tiny
    assert batch.mismatches(p) == []
    outputs = model.forward_batch(batch)
    assert set(outputs) == set(OUTPUTS) | {"attribute_logits"} == set(output_names(p.model))
    for name, shape in output_shapes(p, batch=2).items():
        assert tuple(outputs[name].shape) == shape, name
        assert outputs[name].dtype == torch.float32, name
        assert torch.isfinite(outputs[name]).all(), name
    assert set(output_layout(p)) == set(output_names(p.model))


@pytest.mark.parametrize("preset", ["default", "large"])
def test_bigger_presets_build_on_the_meta_device(preset):
    p = pipeline(preset)
    with torch.device("meta"):
        model = build_model(p)
        b, n = 1, len(p.data.rig.cameras)
        h, w = p.data.rig.image_height, p.data.rig.image_width
        fine, lift = model.image_encoder(torch.zeros(b * n, 3, h, w))
        depth_logits, context = model.depth_head(lift)
        grid_x, grid_y = model.grid
        bev = model.bev_encoder(torch.zeros(b, p.model.neck_channels, grid_x, grid_y))
        detections = model.detection_head(bev)
        plans, scores = model.planning_head(bev, torch.zeros(b, 3), torch.zeros(b, dtype=torch.long))
    shapes = output_shapes(p, batch=b)
    assert tuple(depth_logits.unflatten(0, (b, n)).shape) == shapes["depth_logits"]
    assert tuple(model.segmentation_head(fine).unflatten(0, (b, n)).shape) == shapes["seg_logits"]
    assert tuple(context.shape) == (b * n, p.model.neck_channels, *shapes["depth_logits"][-2:])
    assert {name: tuple(tensor.shape) for name, tensor in detections.items()} == {
        name: shapes[name] for name in output_names(p.model) if name in ("heatmap", "box_regression", "attribute_logits")}
    assert tuple(plans.shape) == shapes["plan_trajectories"] and tuple(scores.shape) == shapes["plan_scores"]


def test_gradient_reaches_every_parameter(tiny):
    p, _, batch = tiny
    torch.manual_seed(1)
    model = build_model(p)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    # timm zero-initialises each residual block's last BN scale, which blocks that branch's
    # gradient until the first step; after one step every parameter must receive gradient.
    for _ in range(2):
        optimizer.zero_grad()
        model.loss(model.forward_batch(batch), batch)["total"].backward()
        optimizer.step()
    dead = [name for name, param in model.named_parameters()
            if param.grad is None or not torch.isfinite(param.grad).all() or param.grad.abs().sum() == 0]
    if p.model.planning_modes == 1:  # one mode: its score's softmax is constant, so it has nothing to learn
        dead = [name for name in dead if not name.startswith("planning_head.score.")]
    assert dead == []


def test_channels_last_images_compute_what_nchw_computes_and_keep_the_weights_layout(tiny):
    """The backbone runs NHWC (its features come out channels-last) for speed only: outputs and loss equal the
    NCHW network's to float rounding, the gradient too, and the weights keep their NCHW strides (what
    checkpoints, DDP/FSDP2 and export see). The gradient's bound is looser than the outputs': the kernels' other
    summation order moves the outputs by ~1e-5 relative, which the losses (target assignment, softmax depth)
    turn into ~1e-3 of the whole gradient, and up to 2% in a zero-initialised residual BN scale whose
    gradient cancels. A wrong layout (a kernel reading NHWC memory as NCHW) moves the outputs by O(1)."""
    p, model, batch = tiny
    results, lifted = {}, []
    hook = model.image_encoder.register_forward_hook(lambda module, args, out: lifted.append(out[1]))
    try:
        for channels_last in (True, False):
            model.image_encoder.channels_last = channels_last
            model.zero_grad()
            outputs = model.forward_batch(batch)
            assert lifted.pop().is_contiguous(memory_format=torch.channels_last) == channels_last
            loss = model.loss(outputs, batch)["total"]
            loss.backward()
            grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
            results[channels_last] = outputs, loss.detach(), grads
    finally:  # the module's network is shared with the other tests
        hook.remove()
        model.image_encoder.channels_last = True
    (out_nhwc, loss_nhwc, grad_nhwc), (out_nchw, loss_nchw, grad_nchw) = results[True], results[False]
    for name in out_nchw:
        torch.testing.assert_close(out_nhwc[name], out_nchw[name], rtol=1e-4, atol=1e-4, msg=name)
    torch.testing.assert_close(loss_nhwc, loss_nchw, rtol=1e-5, atol=1e-5)
    assert grad_nhwc.keys() == grad_nchw.keys()
    whole_nhwc, whole_nchw = (torch.cat([grads[name].flatten() for name in grad_nchw])
                              for grads in (grad_nhwc, grad_nchw))
    assert (whole_nhwc - whole_nchw).norm() / whole_nchw.norm() < 1e-2
    conv = model.image_encoder.backbone.stem.conv
    assert conv.weight.is_contiguous() and grad_nhwc["image_encoder.backbone.stem.conv.weight"].is_contiguous()


def test_loss_terms_are_finite_and_weighted(tiny):
    p, model, batch = tiny
    outputs = model.forward_batch(batch)
    terms = model.loss(outputs, batch)
    for name in ("det_heatmap", "det_box", "depth", "segmentation", "plan_l2", "plan_cls", "plan_collision"):
        assert torch.isfinite(terms[name]) and terms[name] >= 0, name
    w = p.model.loss_weights
    expected = sum(getattr(w, t) * terms[t] for t in ("detection", "depth", "segmentation", "planning"))
    torch.testing.assert_close(terms["total"], expected)
    heavier = pipeline("tiny", "model.loss_weights.depth=3.0")
    terms3 = build_model(heavier).loss(outputs, batch)
    torch.testing.assert_close(terms3["total"] - terms["total"], 2 * terms["depth"])


def test_the_velocity_weight_scales_only_the_velocity_error_of_the_box_regression(tiny):
    p, model, batch = tiny
    outputs = model.forward_batch(batch)
    box = {w: build_model(pipeline("tiny", f"model.loss_weights.velocity={w}")).loss(outputs, batch)["det_box"]
           for w in (0.0, 0.2, 1.0)}
    velocity_part = box[0.2] - box[0.0]
    assert velocity_part > 0  # the random batch's boxes move, and an untrained head does not know how
    torch.testing.assert_close(box[1.0] - box[0.0], 5 * velocity_part)
    still = random_batch(p, batch_size=2, seed=1)
    still.boxes[..., 7:9] = outputs["box_regression"].new_zeros(())  # targets without motion...
    outputs["box_regression"] = outputs["box_regression"].detach().clone()
    outputs["box_regression"][:, 8:10] = 0  # ...and a head that predicts none: the weight changes nothing
    heavy = build_model(pipeline("tiny", "model.loss_weights.velocity=3.0"))
    torch.testing.assert_close(heavy.loss(outputs, still)["det_box"], model.loss(outputs, still)["det_box"])


def test_the_road_user_depth_weight_is_a_weighted_mean_over_road_users_pixels(tiny):
    """depth_road_users = w: each road user's pixel counts 1 + w times in the depth cross entropy's mean; 0 is the
    plain mean; an image without road users is scored as without the weight."""
    from stack.models.losses import depth_loss
    from stack.models.targets import downsample_labels, encode_depth

    p, model, batch = tiny
    outputs = model.forward_batch(batch)
    plain = depth_loss(outputs, batch, pipeline("tiny"))
    torch.testing.assert_close(plain, model.loss(outputs, batch)["depth"])
    batch = random_batch(p, batch_size=2, seed=0)
    batch.semantic[:, :, 40:80, 64:160] = p.model.segmentation_classes.index("car")  # a car in every image
    weighted = pipeline("tiny", "model.loss_weights.depth_road_users=4.0")
    target = encode_depth(batch.depth.float(), p.model.feature_stride, p.model.depth).flatten(0, 1).long()
    entropy = torch.nn.functional.cross_entropy(outputs["depth_logits"].float().flatten(0, 1), target,
                                                ignore_index=255, reduction="none")
    classes = downsample_labels(batch.semantic, p.model.feature_stride).flatten(0, 1)
    users = torch.zeros_like(classes, dtype=torch.bool)
    for index, name in enumerate(p.model.segmentation_classes):
        users |= (classes == index) & (name in p.model.detection_classes)
    labelled = target != 255
    assert (users & labelled).sum() > 0 and (~users & labelled).sum() > 0  # the random batch shows both
    weight = (1 + 4.0 * users.float()) * labelled.float()
    torch.testing.assert_close(depth_loss(outputs, batch, weighted), (entropy * weight).sum() / weight.sum())
    no_users = random_batch(p, batch_size=2, seed=1)
    road = p.model.segmentation_classes.index("road")
    no_users.semantic[no_users.semantic != 255] = road
    torch.testing.assert_close(depth_loss(outputs, no_users, weighted), depth_loss(outputs, no_users, pipeline("tiny")))


def test_loss_survives_empty_and_unlabelled_batches(tiny):
    p, model, batch = tiny
    empty = random_batch(p, batch_size=2, seed=3)
    empty.box_labels[:] = -1
    empty.boxes[:] = 0
    empty.semantic[:] = 255
    empty.depth[:] = 0
    terms = model.loss(model.forward_batch(empty), empty)
    assert all(torch.isfinite(v) for v in terms.values())
    assert terms["det_box"] == 0 and terms["depth"] == 0 and terms["segmentation"] == 0


def test_bf16_autocast_keeps_losses_finite_and_plans_in_fp32(tiny):
    p, model, batch = tiny
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model.forward_batch(batch)
        terms = model.loss(outputs, batch)
    assert outputs["heatmap"].dtype == torch.bfloat16
    assert outputs["plan_trajectories"].dtype == torch.float32  # metres need more than bf16's 8 bits
    assert all(torch.isfinite(v) for v in terms.values())


def test_collision_term_pushes_a_plan_out_of_a_box(tiny):
    p, model, batch = tiny
    outputs = {k: v.detach() for k, v in model.forward_batch(batch).items()}
    inside = batch.future_trajectory.clone()
    batch.boxes[:, 0] = torch.tensor([0, 0, 0.8, 4.5, 1.9, 1.6, 0, 0, 0], dtype=torch.float32)
    batch.boxes[:, 0, :2] = inside[:, 2]  # a parked car on the 1.5 s waypoint
    batch.box_labels[:, 0] = 0
    outputs["plan_trajectories"] = inside[:, None].repeat(1, p.model.planning_modes, 1, 1).requires_grad_()
    terms = model.loss(outputs, batch)
    assert terms["plan_collision"] > 0
    terms["plan_collision"].backward()
    assert outputs["plan_trajectories"].grad.abs().sum() > 0


def test_fixed_geometry_matches_per_batch_geometry(tiny):
    p, model, batch = tiny
    fixed, dynamic = fixed_and_per_batch_outputs(model, batch)
    for name in dynamic:
        torch.testing.assert_close(fixed[name], dynamic[name], atol=1e-4, rtol=1e-4)


def test_backbone_errors_say_what_to_do(tmp_path):
    from stack.errors import StackError

    p = pipeline("tiny")
    batch = random_batch(p, batch_size=1)
    with pytest.raises(StackError, match="fix_geometry"):
        build_model(p)(batch.images, batch.ego_status, batch.command)
    with pytest.raises(StackError, match="timm has no model"):
        build_model(pipeline("tiny", "model.backbone=resnet_nonexistent"))
    with pytest.raises(StackError, match="does not exist"):
        build_model(pipeline("tiny", f"model.backbone_checkpoint={tmp_path / 'missing.pth'}"))


def test_backbone_checkpoint_is_loaded(tmp_path):
    import timm

    source = timm.create_model("resnet10t", pretrained=False)
    path = tmp_path / "resnet10t.pth"
    torch.save(source.state_dict(), path)
    model = build_model(pipeline("tiny", "model.backbone=resnet10t", f"model.backbone_checkpoint={path}"))
    torch.testing.assert_close(model.image_encoder.backbone.state_dict()["conv1.0.weight"],
                               source.state_dict()["conv1.0.weight"])


def test_checkpoint_of_another_backbone_is_refused(tmp_path):
    import timm

    from stack.errors import StackError

    path = tmp_path / "resnet10t.pth"
    torch.save(timm.create_model("resnet10t", pretrained=False).state_dict(), path)
    with pytest.raises(StackError, match=r"does not fit model.backbone 'regnetx_002'.*weights are absent"):
        build_model(pipeline("tiny", "model.backbone=regnetx_002", f"model.backbone_checkpoint={path}"))


class _Marker:
    """Pickled by reference: unpickling it would import this test module and run `__reduce__`'s callable."""

    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/stack-backbone-pickle-ran",))


@pytest.mark.parametrize("content, needle", [
    ("pickle", "not a weights file that can be read without running code from it"),
    ("pickle", "GLOBAL posix.system"),
    ("text", "not a weights file that can be read without running code from it"),
    ("list", "holds no state dict: expected a resnet10t state dict (names to tensors), found a list"),
    ("empty-safetensors", "not a weights file that can be read without running code from it"),
])
def test_a_backbone_checkpoint_that_is_no_state_dict_is_refused_in_one_line(tmp_path, capsys, content, needle):
    """`model.backbone_checkpoint` is a file the user names: never unpickled, and anything but tensors is exit 2
    with what to give instead (it was timm's loader's traceback)."""
    import pickle

    from stack.cli import main

    path = tmp_path / ("weights.safetensors" if content == "empty-safetensors" else "weights.pth")
    if content == "pickle":
        path.write_bytes(pickle.dumps({"conv1.0.weight": _Marker()}, protocol=2))
    elif content == "text":
        path.write_text("these are not weights\n")
    elif content == "list":
        torch.save([torch.zeros(1)], path)
    else:
        path.write_bytes(b"")
    marker = __import__("pathlib").Path("/tmp/stack-backbone-pickle-ran")
    marker.unlink(missing_ok=True)
    code = main(["profile", "-c", "configs/pipeline.yaml", "-c", "configs/presets/tiny.yaml", "model.backbone=resnet10t",
                 f"model.backbone_checkpoint={path}", f"data.root={tmp_path / 'nodata'}",
                 f"train.out_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and needle in err, err
    assert f"model.backbone_checkpoint {str(path)!r}" in err and not marker.exists()


def test_a_safetensors_backbone_checkpoint_is_loaded(tmp_path):
    import timm
    from safetensors.torch import save_file

    source = timm.create_model("resnet10t", pretrained=False)
    path = tmp_path / "resnet10t.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    model = build_model(pipeline("tiny", "model.backbone=resnet10t", f"model.backbone_checkpoint={path}"))
    torch.testing.assert_close(model.image_encoder.backbone.state_dict()["layer1.0.conv1.weight"],
                               source.state_dict()["layer1.0.conv1.weight"])


@pytest.mark.parametrize("device", device_params())
def test_train_step_and_decoders_run_on_device(device):
    from stack.models.decoders import decode_all

    p = pipeline("tiny")
    model = build_model(p).to(device)
    batch = random_batch(p, batch_size=1, seed=4).to(device)
    outputs = model.forward_batch(batch)
    terms = model.loss(outputs, batch)
    terms["total"].backward()
    assert all(torch.isfinite(v) for v in terms.values())
    assert all(param.grad is not None and param.grad.device.type == device for param in model.parameters())
    decoded = decode_all({k: v.detach() for k, v in outputs.items()}, p)
    assert decoded["depth"].device.type == device and len(decoded["detections"]) == 1
