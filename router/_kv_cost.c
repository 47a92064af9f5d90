/* The numeric core of `kv_cache_aware` placement in one native call: router/policy_kv.py's
 * `_core`, the same numbers in the same order.
 *
 * Why native: the core runs twice per two-leg request in the coordinator (once per leg) over
 * every candidate, and in Python it is five list comprehensions, a sum, a max and a min: most of
 * `KvCacheAwarePolicy.select`'s time, the largest share of the one coordinator's CPU per request
 * (bench/RESULTS.md, "coordinator · native placement core"). Here it is one pass over the
 * candidates plus one over their costs.
 *
 * Exactness: every cost is the same IEEE double the Python expression gives (operands converted
 * to double one by one, operations in the Python order; setup.py builds with -ffp-contract=off so
 * no multiply-add is fused), so the pick, the ties and the explanation's scores are identical.
 * The caller uses it only where that holds: float weights, no candidate of unknown match
 * (router/policy_kv.py). tests/router/test_kv_cost_native.py compares both on random inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* An int argument or a load field as a C long long; -1 with an exception set on failure. */
static int as_ll(PyObject *o, long long *out, const char *what) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, found %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static int as_d(PyObject *o, double *out, const char *what) {
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s must be a number, found %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = v;
    return 0;
}

/* list.append(i); -1 with an exception set on failure. */
static int append_index(PyObject *list, Py_ssize_t i) {
    PyObject *x = PyLong_FromSsize_t(i);
    if (x == NULL)
        return -1;
    int rc = PyList_Append(list, x);
    Py_DECREF(x);
    return rc;
}

PyDoc_STRVAR(core_doc,
"core(servers, matched, loads, block_size, cap, num_tokens, prefill_weight, load_tokens_weight,\n"
"     load_requests_weight, pinned, affinity_bonus, hotspot_factor, hotspot_slack,\n"
"     max_batch_size, load_cap) -> (matched_tokens, costs, tied, hotspot, load_capped, limit)\n\n"
"router/policy_kv.py `_core` (its docstring has the arguments and the answer).");

enum { A_SERVERS, A_MATCHED, A_LOADS, A_BS, A_CAP, A_NT, A_PW, A_TW, A_RW, A_PIN, A_BONUS,
       A_HF, A_SLACK, A_MBS, A_LCAP, N_ARGS };

static PyObject *core(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != N_ARGS) {
        PyErr_Format(PyExc_TypeError, "core() takes %d arguments, found %zd", N_ARGS, nargs);
        return NULL;
    }
    PyObject *servers = args[A_SERVERS], *mdict = args[A_MATCHED], *loads = args[A_LOADS];
    if (!PyList_Check(servers) || !PyList_Check(loads)) {
        PyErr_SetString(PyExc_TypeError, "servers and loads must be lists");
        return NULL;
    }
    if (mdict != Py_None && !PyDict_Check(mdict)) {
        PyErr_SetString(PyExc_TypeError, "matched must be a dict or None");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(servers);
    if (n < 1 || PyList_GET_SIZE(loads) != n) {
        PyErr_Format(PyExc_ValueError, "expected one load per server and at least one server, "
                     "found %zd servers and %zd loads", n, PyList_GET_SIZE(loads));
        return NULL;
    }
    long long B, cap, nt, pin, mbs;
    double pw, tw, rw, bonus, hf, slack, lcap;
    if (as_ll(args[A_BS], &B, "block_size") || as_ll(args[A_CAP], &cap, "cap") ||
        as_ll(args[A_NT], &nt, "num_tokens") || as_ll(args[A_PIN], &pin, "pinned") ||
        as_ll(args[A_MBS], &mbs, "max_batch_size") ||
        as_d(args[A_PW], &pw, "prefill_weight") || as_d(args[A_TW], &tw, "load_tokens_weight") ||
        as_d(args[A_RW], &rw, "load_requests_weight") || as_d(args[A_BONUS], &bonus, "affinity_bonus") ||
        as_d(args[A_HF], &hf, "hotspot_factor") || as_d(args[A_SLACK], &slack, "hotspot_slack") ||
        as_d(args[A_LCAP], &lcap, "load_cap"))
        return NULL;

    PyObject *matched = NULL, *costs = NULL, *tied = NULL, *hs = NULL, *lc = NULL, *ans = NULL;
    double *cv = NULL;
    long long *req = NULL;
    char *hot = NULL;
    cv = PyMem_Malloc(n * sizeof(double));
    req = PyMem_Malloc(n * sizeof(long long));
    hot = PyMem_Calloc(n, 1);
    matched = PyList_New(n);
    costs = PyList_New(n);
    if (cv == NULL || req == NULL || hot == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (matched == NULL || costs == NULL)
        goto fail;

    long long sum = 0, maxr = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long mt = 0;
        if (mdict != Py_None) {
            PyObject *v = PyDict_GetItemWithError(mdict, PyList_GET_ITEM(servers, i));
            if (v == NULL && PyErr_Occurred())
                goto fail;
            if (v != NULL) {
                if (as_ll(v, &mt, "a matched block count"))
                    goto fail;
                mt *= B;
            }
        }
        if (!(mt < cap))    /* `mt if mt < cap else cap` */
            mt = cap;
        PyObject *ld = PyList_GET_ITEM(loads, i), *r_o, *t_o;
        if (PyTuple_Check(ld) && PyTuple_GET_SIZE(ld) == 2) {
            r_o = PyTuple_GET_ITEM(ld, 0);
            t_o = PyTuple_GET_ITEM(ld, 1);
        } else if (PyList_Check(ld) && PyList_GET_SIZE(ld) == 2) {
            r_o = PyList_GET_ITEM(ld, 0);
            t_o = PyList_GET_ITEM(ld, 1);
        } else {
            PyErr_SetString(PyExc_TypeError, "a load must be a (requests, tokens) pair");
            goto fail;
        }
        long long r, tok;
        if (as_ll(r_o, &r, "a load's requests") || as_ll(t_o, &tok, "a load's tokens"))
            goto fail;
        PyObject *m = PyLong_FromLongLong(mt);
        if (m == NULL)
            goto fail;
        PyList_SET_ITEM(matched, i, m);
        /* pw * (num_tokens - mt) + tw * tok + rw * req, left to right */
        double c = pw * (double)(nt - mt);
        c = c + tw * (double)tok;
        cv[i] = c + rw * (double)r;
        req[i] = r;
        sum += r;
        if (i == 0 || r > maxr)
            maxr = r;
    }
    if (pin >= 0 && pin < n)
        cv[pin] -= bonus * (double)nt;

    /* hot: the hotspot rule first, then the load cap for the others (the Python dict's order) */
    Py_ssize_t n_hot = 0;
    double limit = 0.0;
    hs = PyList_New(0);
    lc = PyList_New(0);
    if (hs == NULL || lc == NULL)
        goto fail;
    if (hf != 0.0) {
        limit = hf * (double)sum / (double)n + slack;
        if ((double)maxr > limit) {
            for (Py_ssize_t i = 0; i < n; i++) {
                if ((double)req[i] > limit) {
                    if (append_index(hs, i) < 0)
                        goto fail;
                    hot[i] = 1;
                    n_hot++;
                }
            }
        }
    }
    if (mbs != 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!hot[i] && (double)req[i] / (double)mbs >= lcap) {
                if (append_index(lc, i) < 0)
                    goto fail;
                hot[i] = 1;
                n_hot++;
            }
        }
    }
    int skip = n_hot > 0 && n_hot < n;
    double best = 0.0;
    int have = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (skip && hot[i])
            continue;
        /* min() keeps the first of equal values and compares with `<` */
        if (!have || cv[i] < best) {
            best = cv[i];
            have = 1;
        }
    }
    double tol = best + 1e-9 * (fabs(best) > 1.0 ? fabs(best) : 1.0);
    tied = PyList_New(0);
    if (tied == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyFloat_FromDouble(cv[i]);
        if (f == NULL)
            goto fail;
        PyList_SET_ITEM(costs, i, f);
        if (cv[i] <= tol && !(skip && hot[i])) {
            if (append_index(tied, i) < 0)
                goto fail;
        }
    }
    PyObject *lim = PyFloat_FromDouble(limit);
    if (lim == NULL || (ans = PyTuple_New(6)) == NULL) {
        Py_XDECREF(lim);
        goto fail;
    }
    PyTuple_SET_ITEM(ans, 0, matched);     /* the tuple owns them now */
    PyTuple_SET_ITEM(ans, 1, costs);
    PyTuple_SET_ITEM(ans, 2, tied);
    PyTuple_SET_ITEM(ans, 3, hs);
    PyTuple_SET_ITEM(ans, 4, lc);
    PyTuple_SET_ITEM(ans, 5, lim);
    matched = costs = tied = hs = lc = NULL;
fail:
    Py_XDECREF(matched);
    Py_XDECREF(costs);
    Py_XDECREF(tied);
    Py_XDECREF(hs);
    Py_XDECREF(lc);
    PyMem_Free(cv);
    PyMem_Free(req);
    PyMem_Free(hot);
    return ans;
}

static PyMethodDef methods[] = {
    {"core", (PyCFunction)(void (*)(void))core, METH_FASTCALL, core_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._kv_cost",
    "Native numeric core of kv_cache_aware placement (router/policy_kv.py `_core`); see router/_kv_cost.c.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kv_cost(void) {
    return PyModule_Create(&module);
}
