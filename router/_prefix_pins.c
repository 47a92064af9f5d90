/* kv_cache_aware's implicit sessions (router/prefix_pins.py `PrefixPins`): a prompt's marks (block
 * keys at fixed positions) -> the id of the server its latest placement went to, as two generations
 * of open-addressing tables of (u64 key, i32 id) entries.
 *
 * Why native: the registry is read and written on every placement, and the Python recipe cost
 * ~11k instructions per placement (a memoryview of the prompt's keys, a binary search, the
 * writes), ~9% of a 4k-token `select` (bench/routing/placement.py), over issue 40's CPU budget.
 * Here `find` reads the keys through the buffer protocol once, keeps the prompt's marks, and
 * `put` writes those marks: two calls per placement (`credit` is `find` plus kv_cache_aware's
 * implicit-session credit over the index's matches, router/prefix_pins.py `session_credit`).
 *
 * Marks: positions stride*j - 1 for j = 1..near, then (near + (j - near) * far) * stride - 1 (the
 * same as router/prefix_pins.py `PrefixPins.position`). Keys are chained, so the marks
 * registered for a prompt are a prefix of its marks: the deepest registered one is found by a
 * binary search (after the deepest of all, a repeat).
 *
 * Bound: entries go into the current generation; when it holds `limit` keys and a new one comes,
 * it becomes the old generation (the old one is dropped) and a new current one starts. Lookups
 * read the current generation, then the old. Servers are small ids in the table (`names`, `ids`);
 * no entry is deleted: a server that leaves keeps its id, which then names no server (None).
 * Keys are mixed with a per-process random seed. The names are strings (no cycles): the type is
 * not tracked by the cyclic collector.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t key;
    int32_t id;         /* -1: empty */
} Slot;

typedef struct {
    Slot *tab;
    size_t cap;         /* a power of two, >= 2 * limit */
    size_t used;
} Gen;

typedef struct {
    PyObject_HEAD
    Gen cur, old;
    size_t limit;
    Py_ssize_t stride, near, far;
    uint64_t *marks;    /* the last `find`'s prompt marks */
    Py_ssize_t nmarks, marks_cap;
    PyObject *names;    /* list: id -> server (None: it left) */
    PyObject *ids;      /* dict: server -> id */
} PinTable;

static uint64_t seed;

static inline size_t slot_of(uint64_t key, size_t cap) {
    uint64_t h = key ^ seed;      /* murmur3's finalizer */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return (size_t)h & (cap - 1);
}

static int gen_init(Gen *g, size_t cap) {
    g->tab = PyMem_Malloc(cap * sizeof(Slot));
    if (g->tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < cap; i++)
        g->tab[i].id = -1;
    g->cap = cap;
    g->used = 0;
    return 0;
}

static inline int32_t gen_get(const Gen *g, uint64_t key) {
    if (g->tab == NULL)
        return -1;
    size_t m = g->cap - 1;
    for (size_t i = slot_of(key, g->cap);; i = (i + 1) & m) {
        const Slot *s = &g->tab[i];
        if (s->id < 0)
            return -1;
        if (s->key == key)
            return s->id;
    }
}

static inline int32_t lookup(const PinTable *t, uint64_t key) {
    int32_t id = gen_get(&t->cur, key);
    return id >= 0 ? id : gen_get(&t->old, key);
}

/* Set key -> id in the current generation, which rolls over when it is full. */
static int pin(PinTable *t, uint64_t key, int32_t id) {
    Gen *g = &t->cur;
    size_t m = g->cap - 1;
    size_t i = slot_of(key, g->cap);
    for (;; i = (i + 1) & m) {
        Slot *s = &g->tab[i];
        if (s->id < 0)
            break;
        if (s->key == key) {
            s->id = id;
            return 0;
        }
    }
    if (g->used >= t->limit) {
        Gen fresh;
        if (gen_init(&fresh, g->cap) < 0)
            return -1;
        PyMem_Free(t->old.tab);
        t->old = t->cur;
        t->cur = fresh;
        g = &t->cur;
        for (i = slot_of(key, g->cap); g->tab[i].id >= 0; i = (i + 1) & m)
            ;
    }
    g->tab[i].key = key;
    g->tab[i].id = id;
    g->used++;
    return 0;
}

static inline Py_ssize_t count_of(const PinTable *t, Py_ssize_t n) {
    Py_ssize_t nearkeys = t->near * t->stride;
    return n < nearkeys ? n / t->stride : t->near + (n - nearkeys) / (t->far * t->stride);
}

static inline Py_ssize_t position_of(const PinTable *t, Py_ssize_t j) {
    return j <= t->near ? j * t->stride - 1 : (t->near + (j - t->near) * t->far) * t->stride - 1;
}

static PyObject *pt_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"stride", "near", "far", "limit", NULL};
    Py_ssize_t stride, near, far, limit;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nnnn", names, &stride, &near, &far, &limit))
        return NULL;
    if (stride < 1 || near < 0 || far < 1 || limit < 1) {
        PyErr_Format(PyExc_ValueError, "PinTable: stride, far and limit must be >= 1 and near >= 0, "
                     "found %zd, %zd, %zd, %zd", stride, near, far, limit);
        return NULL;
    }
    PinTable *t = (PinTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    size_t cap = 16;
    while (cap < 2 * (size_t)limit)
        cap <<= 1;
    t->stride = stride;
    t->near = near;
    t->far = far;
    t->limit = (size_t)limit;
    if ((t->names = PyList_New(0)) == NULL || (t->ids = PyDict_New()) == NULL ||
            gen_init(&t->cur, cap) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void pt_dealloc(PinTable *t) {
    Py_XDECREF(t->names);
    Py_XDECREF(t->ids);
    PyMem_Free(t->cur.tab);
    PyMem_Free(t->old.tab);
    PyMem_Free(t->marks);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

PyDoc_STRVAR(find_doc,
"find(keys) -> (server, covered): the server of the deepest registered mark of a prompt whose\n"
"block keys are `keys` (a buffer of 8-byte ints: a uint64 array; or a list of ints) and the block\n"
"keys that mark covers; (None, 0) when none is registered or its server left. Keeps the prompt's\n"
"marks for `put`.");

/* The prompt's marks into t->marks; -1 on an error. */
static int read_marks(PinTable *t, PyObject *keys) {
    Py_ssize_t n;
    int list = PyList_Check(keys);
    Py_buffer b = {0};
    if (list) {
        n = PyList_GET_SIZE(keys);
    } else {
        if (PyObject_GetBuffer(keys, &b, PyBUF_STRIDES) < 0)
            return -1;
        if (b.ndim != 1 || b.itemsize != 8) {
            PyErr_Format(PyExc_ValueError, "find: keys must be one row of 8-byte ints, found %d "
                         "dimensions of %zd bytes", b.ndim, b.itemsize);
            PyBuffer_Release(&b);
            return -1;
        }
        n = b.shape[0];
    }
    Py_ssize_t hi = count_of(t, n);
    if (hi > t->marks_cap) {
        uint64_t *m = PyMem_Realloc(t->marks, (size_t)hi * sizeof(uint64_t));
        if (m == NULL) {
            if (!list)
                PyBuffer_Release(&b);
            PyErr_NoMemory();
            return -1;
        }
        t->marks = m;
        t->marks_cap = hi;
    }
    t->nmarks = 0;
    for (Py_ssize_t j = 1; j <= hi; j++) {
        Py_ssize_t p = position_of(t, j);
        if (list) {
            unsigned long long v = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(keys, p));
            if (v == (unsigned long long)-1 && PyErr_Occurred())
                return -1;
            t->marks[j - 1] = v;
        } else {
            memcpy(&t->marks[j - 1], (const char *)b.buf + p * b.strides[0], 8);
        }
    }
    if (!list)
        PyBuffer_Release(&b);
    t->nmarks = hi;
    return 0;
}

static PyObject *pt_find(PinTable *t, PyObject *keys) {
    if (read_marks(t, keys) < 0)
        return NULL;
    const uint64_t *marks = t->marks;
    Py_ssize_t hi = t->nmarks;
    int32_t id = -1;
    Py_ssize_t depth = 0;
    if (hi > 0) {
        id = lookup(t, marks[hi - 1]);
        if (id >= 0) {
            depth = hi;
        } else {
            Py_ssize_t lo = 0;
            hi -= 1;
            while (lo < hi) {
                Py_ssize_t mid = (lo + hi + 1) >> 1;
                if (lookup(t, marks[mid - 1]) >= 0)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            if (lo) {
                id = lookup(t, marks[lo - 1]);
                depth = lo;
            }
        }
    }
    PyObject *server = id >= 0 ? PyList_GET_ITEM(t->names, id) : Py_None;
    if (server == Py_None)
        depth = 0;
    PyObject *covered = PyLong_FromSsize_t(depth ? position_of(t, depth) + 1 : 0);
    if (covered == NULL)
        return NULL;
    PyObject *out = PyTuple_New(2);
    if (out == NULL) {
        Py_DECREF(covered);
        return NULL;
    }
    Py_INCREF(server);
    PyTuple_SET_ITEM(out, 0, server);
    PyTuple_SET_ITEM(out, 1, covered);
    return out;
}

PyDoc_STRVAR(credit_doc,
"credit(keys, matched, block_size, cap, num_tokens, weight, bonus) -> (server, bonus): `find`,\n"
"then kv_cache_aware's implicit-session credit on its server (router/prefix_pins.py\n"
"`session_credit`, the recipe): `bonus` where that server holds more of the prompt (registered,\n"
"capped at `cap` tokens, or matched) than every other server's match in `matched` (the index's\n"
"dict server -> blocks), else 0.0; plus `weight` x (registered - matched there) / `num_tokens`\n"
"where the registered prefix is deeper. `bonus` unchanged with no server or no tokens.\n"
"TypeError where `matched` is not a dict of ints (the recipe takes any mapping).");

/* One native call per placement instead of `find` and the comparisons in Python (~7k
 * instructions per placement with max/countOf over the matches, issue 40). */
static PyObject *pt_credit(PinTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "credit: expected 7 arguments, found %zd", nargs);
        return NULL;
    }
    PyObject *md = args[1], *wobj = args[5], *bonus = args[6];
    if (!PyDict_CheckExact(md)) {
        PyErr_Format(PyExc_TypeError, "credit: matched must be a dict, found %.100s",
                     Py_TYPE(md)->tp_name);
        return NULL;
    }
    long long bs = PyLong_AsLongLong(args[2]), cap = PyLong_AsLongLong(args[3]),
              nt = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *found = pt_find(t, args[0]);
    if (found == NULL)
        return NULL;
    PyObject *server = PyTuple_GET_ITEM(found, 0);
    PyObject *out;
    if (server == Py_None || nt == 0) {
        out = PyTuple_Pack(2, server, bonus);
        Py_DECREF(found);
        return out;
    }
    long long held = PyLong_AsLongLong(PyTuple_GET_ITEM(found, 1)) * bs, mb = 0, top = 0;
    Py_ssize_t pos = 0, ntop = 0;
    PyObject *k, *v;
    int any = 0;
    while (PyDict_Next(md, &pos, &k, &v)) {
        if (!PyLong_CheckExact(v)) {
            Py_DECREF(found);
            PyErr_Format(PyExc_TypeError, "credit: matched values must be ints, found %.100s",
                         Py_TYPE(v)->tp_name);
            return NULL;
        }
        long long x = PyLong_AsLongLong(v);
        if (x == -1 && PyErr_Occurred()) {
            Py_DECREF(found);
            return NULL;
        }
        if (!any || x > top) {
            top = x;
            ntop = 1;
            any = 1;
        } else if (x == top) {
            ntop++;
        }
    }
    PyObject *m = PyDict_GetItemWithError(md, server);
    Py_DECREF(found);   /* `server` stays alive: t->names holds it */
    if (m != NULL) {
        mb = PyLong_AsLongLong(m);
        if (mb == -1 && PyErr_Occurred())
            return NULL;
    } else if (PyErr_Occurred()) {
        return NULL;
    }
    long long mt = mb * bs;
    if (held > cap)
        held = cap;
    int most = mb == top && mb && ntop == 1;
    int zero = !most && held <= top * bs;
    if (held > mt) {
        /* as Python computes it: weight * (held - mt) / num_tokens */
        double add, b;
        if (PyLong_CheckExact(wobj)) {
            long long w = PyLong_AsLongLong(wobj);
            if (w == -1 && PyErr_Occurred())
                return NULL;
            add = (double)(w * (held - mt)) / (double)nt;
        } else {
            double w = PyFloat_AsDouble(wobj);
            if (w == -1.0 && PyErr_Occurred())
                return NULL;
            add = w * (double)(held - mt) / (double)nt;
        }
        if (zero) {
            b = 0.0;
        } else {
            b = PyFloat_AsDouble(bonus);
            if (b == -1.0 && PyErr_Occurred())
                return NULL;
        }
        PyObject *f = PyFloat_FromDouble(b + add);
        if (f == NULL)
            return NULL;
        out = PyTuple_Pack(2, server, f);
        Py_DECREF(f);
        return out;
    }
    if (zero) {
        PyObject *f = PyFloat_FromDouble(0.0);
        if (f == NULL)
            return NULL;
        out = PyTuple_Pack(2, server, f);
        Py_DECREF(f);
        return out;
    }
    return PyTuple_Pack(2, server, bonus);
}

PyDoc_STRVAR(put_doc,
"put(server): pin every mark of the last `find`'s prompt to `server`.");

static PyObject *pt_put(PinTable *t, PyObject *server) {
    PyObject *idobj = PyDict_GetItemWithError(t->ids, server);
    long id;
    if (idobj != NULL) {
        id = PyLong_AsLong(idobj);
    } else {
        if (PyErr_Occurred())
            return NULL;
        id = (long)PyList_GET_SIZE(t->names);
        if (id > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "put: too many servers");
            return NULL;
        }
        PyObject *v = PyLong_FromLong(id);
        if (v == NULL || PyDict_SetItem(t->ids, server, v) < 0 || PyList_Append(t->names, server) < 0) {
            Py_XDECREF(v);
            return NULL;
        }
        Py_DECREF(v);
    }
    for (Py_ssize_t j = 0; j < t->nmarks; j++)
        if (pin(t, t->marks[j], (int32_t)id) < 0)
            return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(remove_doc,
"remove_server(server): forget the prefixes pinned to a server that left (its id is never\n"
"given again: a server of that name later gets a new one).");

static PyObject *pt_remove(PinTable *t, PyObject *server) {
    PyObject *idobj = PyDict_GetItemWithError(t->ids, server);
    if (idobj == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Py_ssize_t id = PyLong_AsSsize_t(idobj);
    Py_INCREF(Py_None);
    if (PyList_SetItem(t->names, id, Py_None) < 0 || PyDict_DelItem(t->ids, server) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static Py_ssize_t pt_len(PinTable *t) {
    return (Py_ssize_t)(t->cur.used + t->old.used);
}

static PyMethodDef pt_methods[] = {
    {"find", (PyCFunction)pt_find, METH_O, find_doc},
    {"credit", (PyCFunction)(void (*)(void))pt_credit, METH_FASTCALL, credit_doc},
    {"put", (PyCFunction)pt_put, METH_O, put_doc},
    {"remove_server", (PyCFunction)pt_remove, METH_O, remove_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods pt_as_sequence = {
    .sq_length = (lenfunc)pt_len,
};

static PyTypeObject PinTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "router._prefix_pins.PinTable",
    .tp_basicsize = sizeof(PinTable),
    .tp_dealloc = (destructor)pt_dealloc,
    .tp_as_sequence = &pt_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PinTable(stride, near, far, limit): prompt marks -> server (router/_prefix_pins.c).",
    .tp_methods = pt_methods,
    .tp_new = pt_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._prefix_pins",
    "kv_cache_aware's implicit sessions (router/prefix_pins.py); see router/_prefix_pins.c.",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__prefix_pins(void) {
    PyObject *os = PyImport_ImportModule("os");
    PyObject *raw = os ? PyObject_CallMethod(os, "urandom", "i", 8) : NULL;
    Py_XDECREF(os);
    if (raw == NULL)
        return NULL;
    memcpy(&seed, PyBytes_AS_STRING(raw), sizeof seed);
    Py_DECREF(raw);
    if (PyType_Ready(&PinTableType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&PinTableType);
    if (PyModule_AddObject(mod, "PinTable", (PyObject *)&PinTableType) < 0) {
        Py_DECREF(&PinTableType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
