"""The few JAX APIs that moved between jax 0.6 and 0.12, behind one name each."""
from __future__ import annotations

import jax
from jax import lax

try:  # jax >= 0.7
    shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map  # type: ignore  # noqa: F401 (the module-level name)


def vma(x) -> frozenset:
    """The mesh axes a value varies over inside shard_map (empty outside it or on old jax)."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else getattr(x, "aval", None)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # jax 0.7 - 0.9


def pvary(x, axis_name):
    """Mark a replicated value as varying over `axis_name` (needed to mix it with sharded values)."""
    if axis_name in vma(x):
        return x
    if axis_name not in jax.sharding.get_abstract_mesh().axis_names:
        return x  # a custom_partitioning body (rlk_xla.gspmd): collectives by name, no varying types
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axis_name, to="varying")
    if hasattr(lax, "pvary"):  # pragma: no cover - jax 0.6/0.7
        return lax.pvary(x, axis_name)
    return x  # pragma: no cover - jax without varying types


def result_type(shape, dtype, operands):
    """ShapeDtypeStruct for an ffi_call result: varying over every mesh axis any operand varies
    over (inside shard_map, XLA custom calls do not infer this themselves)."""
    varying = frozenset().union(*(vma(x) for x in operands))
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    # An abstract value of the operands' mesh, reshaped: ffi_call keeps its varying axes.
    aval = jax.typeof(operands[0])
    like = dict(shape=tuple(shape), dtype=jax.numpy.dtype(dtype), weak_type=False)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:  # jax >= 0.10
        return aval.update(**like, manual_axis_type=mat.update(varying=varying))
    return aval.update(**like, vma=varying)  # jax 0.6 - 0.9


def psum_to(ct, like, axis_name):
    """Sum a cotangent over the mesh axes it varies over and its primal `like` does not (what
    shard_map's transpose would do for an un-differentiated body). Without varying types (old
    jax), sum over `axis_name` when the primal was replicated there."""
    if hasattr(jax, "typeof") and (vma(ct) or vma(like)):
        extra = tuple(sorted(vma(ct) - vma(like)))
        return lax.psum(ct, extra) if extra else ct
    return lax.psum(ct, axis_name)  # pragma: no cover - jax without varying types


def aval_mesh(x):
    """The mesh an array's abstract value carries (under jax.jit, a NamedSharding argument's or a
    sharding-constrained value's), or None: not a JAX value (the argument checks name it later), or a
    jax whose avals carry no sharding."""
    if not hasattr(x, "shape") or not hasattr(jax, "typeof"):
        return None
    try:
        aval = jax.typeof(x)
    except TypeError:  # a torch tensor, say
        return None
    return getattr(getattr(aval, "sharding", None), "mesh", None)


def legacy_mesh_size() -> int:
    """The device count of the deprecated `with mesh:` context's mesh (1 when none is entered)."""
    try:
        from jax._src.mesh import thread_resources
    except ImportError:  # pragma: no cover - a jax without it: the form is not seen
        return 1
    mesh = thread_resources.env.physical_mesh
    return 1 if mesh.empty else mesh.size
