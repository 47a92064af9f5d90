/* The KV index's prefix walk (router/kv_query.py `QueryMixin._walk`): one owner-mask probe and
 * one AND per key of a prompt, for every slot at once.
 *
 * Why native: once routed tails expire as fast as they are added (the steady state of distinct
 * tails, from `speculative_ttl_s` on), every expiry bumps a slot's loss count, the memos of the
 * prompts that slot matched stop being exact, and nearly every placement walks its whole prompt:
 * 36% of the coordinator's samples were that loop, and its cost per pair rose ~2.5x at the TTL
 * (bench/RESULTS.md, "coordinator · native prefix walk"). The dict probes stay (their cache misses
 * are the floor); the interpreter's share of each key goes. The Python loop is the same recipe
 * and runs where this module did not build; tests/router/test_kv_walk_native.py checks both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyDoc_STRVAR(walk_doc,
"walk(keys, owners, active) -> [(bits, depth)]\n\n"
"`m = active`; for the i-th key, `x = m & owners.get(key, 0)`: when `x != m`, append\n"
"`(m ^ x, i)` (those slots matched exactly i keys), stop at `x == 0`, else `m = x`. At the\n"
"end, append `(m, len(keys))`. `keys` is a list, `owners` a dict of int masks.");

static PyObject *group(PyObject *out, PyObject *bits, Py_ssize_t depth) {
    /* steals `bits`; returns `out` or NULL */
    if (bits == NULL)
        return NULL;
    PyObject *d = PyLong_FromSsize_t(depth);
    if (d == NULL) {
        Py_DECREF(bits);
        return NULL;
    }
    PyObject *t = PyTuple_Pack(2, bits, d);
    Py_DECREF(bits);
    Py_DECREF(d);
    if (t == NULL)
        return NULL;
    int rc = PyList_Append(out, t);
    Py_DECREF(t);
    return rc < 0 ? NULL : out;
}

/* Masks of up to 64 slots: machine words (an owner mask's bits above 63 cannot survive the AND
 * with such an `active`, so reading it modulo 2^64 is exact). */
static int walk_u64(PyObject *keys, PyObject *owners, unsigned long long m, PyObject *out) {
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyDict_GetItemWithError(owners, PyList_GET_ITEM(keys, i));   /* borrowed */
        unsigned long long x = 0;
        if (o != NULL) {
            x = PyLong_AsUnsignedLongLongMask(o);
            if (x == (unsigned long long)-1 && PyErr_Occurred())
                return -1;
            x &= m;
        } else if (PyErr_Occurred()) {
            return -1;
        }
        if (x != m) {
            if (group(out, PyLong_FromUnsignedLongLong(m ^ x), i) == NULL)
                return -1;
            if (!x)
                return 0;
            m = x;
        }
    }
    return group(out, PyLong_FromUnsignedLongLong(m), n) == NULL ? -1 : 0;
}

/* More slots than a word holds: the same loop on Python ints. */
static int walk_big(PyObject *keys, PyObject *owners, PyObject *active, PyObject *out) {
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *m = active;
    Py_INCREF(m);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyDict_GetItemWithError(owners, PyList_GET_ITEM(keys, i));
        if (o == NULL && PyErr_Occurred())
            goto fail;
        PyObject *x = o != NULL ? PyNumber_And(m, o) : PyLong_FromLong(0);
        if (x == NULL)
            goto fail;
        int same = PyObject_RichCompareBool(x, m, Py_EQ);
        if (same < 0) {
            Py_DECREF(x);
            goto fail;
        }
        if (!same) {
            if (group(out, PyNumber_Xor(m, x), i) == NULL) {
                Py_DECREF(x);
                goto fail;
            }
            int nz = PyObject_IsTrue(x);
            Py_DECREF(m);
            m = x;
            if (nz < 0)
                goto fail;
            if (!nz) {
                Py_DECREF(m);
                return 0;
            }
        } else {
            Py_DECREF(x);
        }
    }
    if (group(out, m, n) == NULL)   /* steals m */
        return -1;
    return 0;
fail:
    Py_DECREF(m);
    return -1;
}

static PyObject *walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "walk() takes 3 arguments, found %zd", nargs);
        return NULL;
    }
    PyObject *keys = args[0], *owners = args[1], *active = args[2];
    if (!PyList_Check(keys) || !PyDict_Check(owners) || !PyLong_Check(active)) {
        PyErr_SetString(PyExc_TypeError, "walk(list, dict, int) expected");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    int rc;
    unsigned long long u = PyLong_AsUnsignedLongLong(active);
    if (u != (unsigned long long)-1 || !PyErr_Occurred()) {
        rc = walk_u64(keys, owners, u, out);
    } else if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();      /* more than 64 slots (or negative): Python ints */
        rc = walk_big(keys, owners, active, out);
    } else {
        rc = -1;
    }
    if (rc < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._kv_walk",
    "The KV index's prefix walk (router/kv_query.py); see router/_kv_walk.c.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kv_walk(void) {
    return PyModule_Create(&module);
}
