"""Write torch.inv and python.inv, the offline intersphinx inventories.

docs/conf.py points intersphinx at these files instead of the sites' own
objects.inv, so that the documentation builds with no network (see the comment
there). Each lists only the names the pages cross-reference, with their URLs
under the real sites. Add a name here when a page references a new one, then
run::

    python docs/_inventories/make_inventories.py

The format is Sphinx's objects.inv version 2 (as ``sphinx.util.inventory``
reads it): four plain header lines, then zlib-compressed lines of
``name domain:role priority uri dispname``, where a ``uri`` ending in ``$``
stands for the name and a ``dispname`` of ``-`` for the name too.
"""

from __future__ import annotations

import pathlib
import zlib

HERE = pathlib.Path(__file__).resolve().parent

# name -> (domain:role, page under https://docs.pytorch.org/docs/stable/; "#<name>" is appended)
TORCH = {
    # tensors, dtypes, devices
    "torch.Tensor": ("py:class", "tensors.html"),
    "torch.dtype": ("py:class", "tensor_attributes.html"),
    "torch.device": ("py:class", "tensor_attributes.html"),
    "torch.float8_e4m3fn": ("py:attribute", "tensor_attributes.html"),
    # ops
    "torch.mm": ("py:function", "generated/torch.mm.html"),
    "torch.addmm": ("py:function", "generated/torch.addmm.html"),
    "torch.matmul": ("py:function", "generated/torch.matmul.html"),
    "torch.bmm": ("py:function", "generated/torch.bmm.html"),
    "torch.einsum": ("py:function", "generated/torch.einsum.html"),
    "torch.nn.functional.linear": ("py:function", "generated/torch.nn.functional.linear.html"),
    # grad modes, autocast, checkpointing
    "torch.no_grad": ("py:class", "generated/torch.no_grad.html"),
    "torch.inference_mode": ("py:class", "generated/torch.inference_mode.html"),
    "torch.autocast": ("py:class", "amp.html"),
    "torch.utils.checkpoint.checkpoint": ("py:function", "checkpoint.html"),
    # compile
    "torch.compile": ("py:function", "generated/torch.compile.html"),
    "torch.compiler.set_stance": ("py:function", "generated/torch.compiler.set_stance.html"),
    # profiler
    "torch.profiler.profile": ("py:class", "profiler.html"),
    "torch.profiler.record_function": ("py:class", "profiler.html"),
    # dispatch modes: documented in the "Extending torch" notes, not in the API reference
    "torch.utils._python_dispatch.TorchDispatchMode": (
        "py:class", "notes/extending.html#extending-all-torch-api-with-modes"),
    # c10d
    "torch.distributed.ProcessGroup": ("py:class", "distributed.html"),
    # the same class under the name autodoc resolves type hints to
    "torch.distributed.distributed_c10d.ProcessGroup": (
        "py:class", "distributed.html#torch.distributed.ProcessGroup"),
    "torch.distributed.ReduceOp": ("py:class", "distributed.html"),
    "torch.distributed.Work": ("py:class", "distributed.html"),
    "torch.distributed.init_process_group": ("py:function", "distributed.html"),
    "torch.distributed.new_group": ("py:function", "distributed.html"),
    "torch.distributed.all_gather_into_tensor": ("py:function", "distributed.html"),
    "torch.distributed.reduce_scatter_tensor": ("py:function", "distributed.html"),
    "torch.distributed.all_reduce": ("py:function", "distributed.html"),
    "torch.distributed.isend": ("py:function", "distributed.html"),
    "torch.distributed.irecv": ("py:function", "distributed.html"),
    "torch.distributed.batch_isend_irecv": ("py:function", "distributed.html"),
    "torch.distributed.device_mesh.DeviceMesh": ("py:class", "distributed.html"),
    "torch.distributed.device_mesh.init_device_mesh": ("py:function", "distributed.html"),
    # DTensor and its TP plans
    "torch.distributed.tensor.DTensor": ("py:class", "distributed.tensor.html"),
    "torch.distributed.tensor.parallel.parallelize_module": ("py:function", "distributed.tensor.parallel.html"),
    "torch.distributed.tensor.parallel.ColwiseParallel": ("py:class", "distributed.tensor.parallel.html"),
    "torch.distributed.tensor.parallel.RowwiseParallel": ("py:class", "distributed.tensor.parallel.html"),
    "torch.distributed.tensor.parallel.SequenceParallel": ("py:class", "distributed.tensor.parallel.html"),
    "torch.distributed.tensor.parallel.loss_parallel": ("py:function", "distributed.tensor.parallel.html"),
    # FSDP2, DDP, pipelining
    "torch.distributed.fsdp.fully_shard": ("py:function", "distributed.fsdp.fully_shard.html"),
    "torch.nn.parallel.DistributedDataParallel": (
        "py:class", "generated/torch.nn.parallel.DistributedDataParallel.html"),
    "torch.distributed.pipelining.schedules.ScheduleGPipe": ("py:class", "distributed.pipelining.html"),
    "torch.distributed.pipelining.schedules.Schedule1F1B": ("py:class", "distributed.pipelining.html"),
}

# name -> (domain:role, page under https://docs.python.org/3/)
PYTHON = {
    "RuntimeError": ("py:exception", "library/exceptions.html"),
    "TypeError": ("py:exception", "library/exceptions.html"),
    "ValueError": ("py:exception", "library/exceptions.html"),
    "collections.Counter": ("py:class", "library/collections.html"),
    "typing.Protocol": ("py:class", "library/typing.html"),
    "collections.abc.Mapping": ("py:class", "library/collections.abc.html"),
    "collections.abc.Sequence": ("py:class", "library/collections.abc.html"),
    "collections.abc.Callable": ("py:class", "library/collections.abc.html"),
    "logging": ("py:module", "library/logging.html#module-$"),
    "dict": ("py:class", "library/stdtypes.html"),
    "str": ("py:class", "library/stdtypes.html"),
    "int": ("py:class", "library/functions.html"),
    "bool": ("py:class", "library/functions.html"),
    "float": ("py:class", "library/functions.html"),
}


def write(path: pathlib.Path, project: str, version: str, entries: dict[str, tuple[str, str]]) -> None:
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    lines = []
    for name, (role, page) in sorted(entries.items()):
        uri = page if "#" in page else f"{page}#$"
        lines.append(f"{name} {role} 1 {uri} -\n")
    path.write_bytes(header.encode() + zlib.compress("".join(lines).encode(), 9))


def main() -> None:
    write(HERE / "torch.inv", "PyTorch", "stable", TORCH)
    write(HERE / "python.inv", "Python", "3", PYTHON)


if __name__ == "__main__":
    main()
