"""Lets a CUDA build of torchvision import beside a CPU build of torch, for the video tests.

transformers' video processors need torchvision, and the package index CI installs from holds
torchvision 0.28.0 (the one for torch 2.13) only as its CUDA build, whose `_C` extension cannot load
on the CPU torch. torchvision then imports without its operators, except that its
`_meta_registrations` registers fake kernels of `torchvision::nms` and `torchvision::qnms` without
asking whether the extension loaded (the other operators' are guarded by `extension._has_ops()`),
and the import fails with "operator torchvision::nms does not exist". Declaring the two schemas here,
only where the extension does not load, is what that guard would have done; the video path uses
none of torchvision's operators (its transforms run on torch's). On a GPU machine with a matching
torchvision nothing of this is on the path. tests/test_video.py pins the failure it works around.
"""
import importlib.util
import os

spec = importlib.util.find_spec("torchvision")
if spec is not None and spec.origin:
    import torch

    try:
        torch.ops.load_library(os.path.join(os.path.dirname(spec.origin), "_C.so"))
    except (OSError, RuntimeError):
        library = torch.library.Library("torchvision", "DEF")
        for name in ("nms", "qnms"):
            library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
