"""CI time: Triton's interpreter patches triton.language again at every @triton.jit helper call.

Under TRITON_INTERPRET=1 a kernel launch patches the language modules its globals name
(`_patch_lang`: every builtin of tl, tl.core, tl.math and tl.tensor wrapped for the interpreter,
found by `inspect.getmembers`), runs the grid, and restores them. But each call of a jit helper
inside the kernel (`_dp4a`, or `tl.max`, itself a jit function of triton.language.standard) runs
`_patch_lang` again, for modules that are patched already: about 0.3 ms a call, paid at every
call (each program, each loop iteration); the vocabulary heads' tests spent over a third of their
time there.

`install` makes a helper call skip it when every language module in the helper's globals is
patched by this launch already; anything else (a helper naming a module the kernel did not, a
call outside a launch) still patches as before, so the interpreted arithmetic is the same.
MINILLM_TEST_REPATCH=1 keeps Triton's behaviour (to compare).

Two more of the interpreter's costs go the same way. Its numpy dtype of a Triton type is looked
up by name instead of rebuilding Triton's table of types a few times an interpreted op. And its
integer-overflow sanitizer is off: for every int32 add, sub or mul it computes the op again in
int64 and the range condition, then drops the assertion, because the interpreter's options have
debug off (Triton 3.9: a kernel that overflows int32 runs without a report, TRITON_DEBUG=1 or
not). It checked nothing and took a fifth to a quarter of the interpreted tests' time.
"""
import dataclasses
import inspect
import os
import warnings


def install():
    """Patch triton.runtime.interpreter, if it has the parts this relies on (a warning where it
    does not: the interpreted tests then run as Triton has them, slower)."""
    if os.environ.get("MINILLM_TEST_REPATCH") == "1":
        return
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:  # no Triton: the tests that need it skip
        return
    if not (callable(getattr(interp, "_patch_lang", None)) and hasattr(interp, "GridExecutor")):
        warnings.warn("tests/interpreter_patching.py: this Triton's interpreter lacks _patch_lang or GridExecutor; "
                      "the interpreted tests run as Triton has them, slower")
        return
    patch_lang, run_grid = interp._patch_lang, interp.GridExecutor.__call__
    langs = (tl, tl.core)
    patched = []  # the language modules (ids) patched during the launch in progress: one list a launch

    class _Unpatched:  # the scope of a skipped patch: nothing to restore
        def restore(self):
            pass

    lang_modules = {}  # a jit function -> the language modules its globals name (fixed at import)

    def modules(fn):
        names = lang_modules.get(fn)
        if names is None:
            names = lang_modules[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                                 if inspect.ismodule(v) and v in langs)
        return names

    def patch_once(fn):
        names = modules(fn)
        if patched and names and names <= patched[-1]:  # (none named: Triton asserts, as before)
            return _Unpatched()
        scope = patch_lang(fn)
        if patched:
            patched[-1] |= names
        return scope

    def run_grid_once(self, *args, **kwargs):
        patched.append(set())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            patched.pop()

    interp._patch_lang = patch_once
    interp.GridExecutor.__call__ = run_grid_once
    if callable(getattr(interp, "_get_np_dtype", None)):
        interp._get_np_dtype = _memoized_np_dtype(interp._get_np_dtype, tl)
    builder = getattr(interp, "interpreter_builder", None)
    if hasattr(getattr(builder, "options", None), "sanitize_overflow"):
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def _memoized_np_dtype(get_np_dtype, tl):
    """The interpreter's numpy dtype of a Triton type, looked up by the scalar type's name: Triton
    builds its table of 19 types (hashing each) at every call, a few times an interpreted op."""
    import numpy as np

    pointer, by_name = np.dtype(np.uint64), {}

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer  # as Triton's: addresses are uint64
        found = by_name.get(scalar.name)
        if found is None:
            found = by_name[scalar.name] = get_np_dtype(scalar)
        return found

    np_dtype.__wrapped__ = get_np_dtype
    return np_dtype
