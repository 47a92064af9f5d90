/* The per-key loops of the KV index's speculative entries (router/kv_speculation.py): a routed
 * prompt's unmatched tail added for the chosen slot, and a due entry's keys expired.
 *
 * Why native: with distinct prompts every placement adds its tail's keys (64 for a 1k-token tail)
 * and expires as many, and those two loops were most of the placement (bench/RESULTS.md,
 * "coordinator · native placement core": `select unique-prompts` ~5x `select`). The dict
 * operations themselves stay (their cache misses are the floor); the interpreter's share of each
 * iteration goes. The Python loops in router/kv_speculation.py are the same recipe and run where
 * this module did not build; tests/router/test_kv_spec_native.py checks both against each other
 * and the index's invariants.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyDoc_STRVAR(add_doc,
"add(keys, owners, owned, spec, bit, deadline) -> list of the keys added\n\n"
"For each key: skip it when the slot holds it (`bit` set in `owners[key]` and the key in\n"
"`owned`); else set `bit` in `owners[key]` (0 when absent) and `spec[key] = deadline`.");

static PyObject *add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "add() takes 6 arguments, found %zd", nargs);
        return NULL;
    }
    PyObject *keys = args[0], *owners = args[1], *owned = args[2], *spec = args[3];
    PyObject *bit = args[4], *deadline = args[5];
    if (!PyList_Check(keys) || !PyDict_Check(owners) || !PyDict_Check(owned) || !PyDict_Check(spec)
        || !PyLong_Check(bit)) {
        PyErr_SetString(PyExc_TypeError, "add(list, dict, dict, dict, int, deadline) expected");
        return NULL;
    }
    PyObject *added = PyList_New(0);
    if (added == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ck = PyList_GET_ITEM(keys, i);
        PyObject *o = PyDict_GetItemWithError(owners, ck);     /* borrowed */
        if (o == NULL && PyErr_Occurred())
            goto fail;
        int has_bit = 0;
        if (o != NULL) {
            PyObject *a = PyNumber_And(o, bit);
            if (a == NULL)
                goto fail;
            has_bit = PyObject_IsTrue(a);
            Py_DECREF(a);
            if (has_bit < 0)
                goto fail;
        }
        if (has_bit) {
            int held = PyDict_Contains(owned, ck);
            if (held < 0)
                goto fail;
            if (held)
                continue;
        } else {
            PyObject *m = o != NULL ? PyNumber_Or(o, bit) : (Py_INCREF(bit), bit);
            if (m == NULL)
                goto fail;
            int rc = PyDict_SetItem(owners, ck, m);
            Py_DECREF(m);
            if (rc < 0)
                goto fail;
        }
        if (PyDict_SetItem(spec, ck, deadline) < 0 || PyList_Append(added, ck) < 0)
            goto fail;
    }
    return added;
fail:
    Py_DECREF(added);
    return NULL;
}

PyDoc_STRVAR(expire_doc,
"expire(keys, spec, owners, log, not_bit, now) -> how many keys expired\n\n"
"For each key whose `spec` deadline is <= `now`: delete it from `spec`, append it to `log`, and\n"
"clear the slot's bit in `owners[key]` (`owners[key] & not_bit`, the entry deleted at 0).");

static PyObject *expire(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "expire() takes 6 arguments, found %zd", nargs);
        return NULL;
    }
    PyObject *keys = args[0], *spec = args[1], *owners = args[2], *log = args[3];
    PyObject *nb = args[4], *now_o = args[5];
    if (!PyTuple_Check(keys) || !PyDict_Check(spec) || !PyDict_Check(owners) || !PyList_Check(log)
        || !PyLong_Check(nb)) {
        PyErr_SetString(PyExc_TypeError, "expire(tuple, dict, dict, list, int, now) expected");
        return NULL;
    }
    double now = PyFloat_AsDouble(now_o);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys), done = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ck = PyTuple_GET_ITEM(keys, i);
        PyObject *d = PyDict_GetItemWithError(spec, ck);
        if (d == NULL) {
            if (PyErr_Occurred())
                return NULL;
            continue;
        }
        double dv = PyFloat_AsDouble(d);
        if (dv == -1.0 && PyErr_Occurred())
            return NULL;
        if (!(dv <= now))
            continue;
        if (PyDict_DelItem(spec, ck) < 0 || PyList_Append(log, ck) < 0)
            return NULL;
        PyObject *o = PyDict_GetItemWithError(owners, ck);
        if (o == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, ck);   /* the invariant: a predicted key has owners */
            return NULL;
        }
        PyObject *m = PyNumber_And(o, nb);
        if (m == NULL)
            return NULL;
        int nz = PyObject_IsTrue(m);
        int rc = nz < 0 ? -1 : nz ? PyDict_SetItem(owners, ck, m) : PyDict_DelItem(owners, ck);
        Py_DECREF(m);
        if (rc < 0)
            return NULL;
        done++;
    }
    return PyLong_FromSsize_t(done);
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL, add_doc},
    {"expire", (PyCFunction)(void (*)(void))expire, METH_FASTCALL, expire_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._kv_spec",
    "Native loops of the KV index's speculative entries (router/kv_speculation.py); see router/_kv_spec.c.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kv_spec(void) {
    return PyModule_Create(&module);
}
