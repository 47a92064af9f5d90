/* The KV index's owner masks (router/kv_owners.py `OwnerTable.masks`): canonical block key -> bitmask of
 * slots, as an open-addressing table of (u64 key, mask) entries, with the index's per-key loops
 * over it: the prefix walk (`OwnerTable.walk`) and the speculative inserts and expiries
 * (`OwnerTable.predict` and `unpredict`, for router/kv_speculation.py).
 *
 * Why a table of its own: once routed tails expire as fast as they are added (the steady state
 * from `speculative_ttl_s` on, bench/RESULTS.md "coordinator · owner table"), nearly every
 * placement walks its whole prompt, and a walk key in a dict costs four dependent cache misses
 * (the dict's index, its entry, the stored key object, the mask object). Here an entry holds the
 * key and the mask's low 64 bits inline: one miss, and the walk prefetches the entries of the keys
 * ahead of it. Masks wider than 64 bits (more than 64 slots) keep their Python int beside the low
 * word; keys that are not u64 ints live in a plain dict, so the type behaves as the dict it
 * replaces for every key. The Python loops in router/kv_owners.py are
 * the same recipes over a dict and run where this module did not build;
 * tests/router/test_owner_map.py checks the table against a dict and both recipes against each
 * other.
 *
 * Masks are positive: an entry is empty iff its low word is 0 and it has no wide mask (the index
 * never stores a 0 mask: router/kv_owners.py's invariants), so storing 0 or a negative int is a
 * ValueError. Deletion shifts later entries back (no tombstones: expiry deletes all the time).
 * Keys are mixed with a per-process random seed, so clients choosing block keys cannot make the
 * probes collide. The map holds ints only (and its dict of other keys), so it is not tracked by
 * the cyclic collector.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_args.h"

typedef struct {
    uint64_t key;
    uint64_t low;       /* the mask's low 64 bits */
    PyObject *wide;     /* the mask when it is >= 2^64 (owned reference), else NULL */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *tab;
    size_t cap;         /* a power of two */
    size_t used;
    PyObject *other;    /* dict of the keys that are not u64 ints, or NULL */
} OwnerMap;

static uint64_t seed;
static PyObject *zero;
static PyTypeObject OwnerMapType;

#define EMPTY(e) ((e)->low == 0 && (e)->wide == NULL)
#define MIN_CAP 16

#if defined(__GNUC__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif

static inline size_t slot_of(uint64_t key, size_t cap) {
    uint64_t h = key ^ seed;      /* murmur3's finalizer */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return (size_t)h & (cap - 1);
}

/* 1: `k` is an int in [0, 2^64) (stored in *out): a table key, or a mask or slot bit that fits a
 * machine word; 0: it is not (another type, negative, wider); -1: an error other than those. */
static int u64_of(PyObject *k, uint64_t *out) {
    if (!PyLong_Check(k))
        return 0;
#if PY_VERSION_HEX < 0x030D0000
    /* The usual key, a non-negative int of at most 64 bits: the masked conversion is a loop over
     * its digits, where PyLong_AsUnsignedLongLong copies it byte by byte through
     * _PyLong_AsByteArray (~10x the instructions: a tenth of a placement that inserts and expires
     * a routed tail, callgrind). Both private helpers are exported through 3.12; later versions
     * take the checked conversion below. */
    if (_PyLong_Sign(k) >= 0) {
        size_t bits = _PyLong_NumBits(k);
        if (bits <= 64) {
            *out = PyLong_AsUnsignedLongLongMask(k);
            return 1;
        }
        if (bits == (size_t)-1 && PyErr_Occurred())
            return -1;
    }
#endif
    unsigned long long v = PyLong_AsUnsignedLongLong(k);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* A mask from Python: a positive int. 0 on success. */
static int mask_of(PyObject *v, uint64_t *low, PyObject **wide) {
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "owner masks are ints, found %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        int neg = PyObject_RichCompareBool(v, zero, Py_LT);
        if (neg != 0) {
            if (neg > 0)
                PyErr_SetString(PyExc_ValueError, "owner masks are positive, found a negative int");
            return -1;
        }
        *low = PyLong_AsUnsignedLongLongMask(v);
        *wide = v;
        return 0;
    }
    if (x == 0) {
        PyErr_SetString(PyExc_ValueError, "owner masks are positive, found 0 (delete the key)");
        return -1;
    }
    *low = x;
    *wide = NULL;
    return 0;
}

static inline PyObject *mask_obj(const Entry *e) {
    if (e->wide != NULL) {
        Py_INCREF(e->wide);
        return e->wide;
    }
    return PyLong_FromUnsignedLongLong(e->low);
}

static inline Entry *find(OwnerMap *m, uint64_t key) {
    size_t mask = m->cap - 1, i = slot_of(key, m->cap);
    for (;;) {
        Entry *e = &m->tab[i];
        if (EMPTY(e))
            return NULL;
        if (e->key == key)
            return e;
        i = (i + 1) & mask;
    }
}

static int resize(OwnerMap *m, size_t cap) {
    Entry *tab = PyMem_Calloc(cap, sizeof(Entry));
    if (tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++) {
        Entry *e = &m->tab[i];
        if (EMPTY(e))
            continue;
        size_t j = slot_of(e->key, cap);
        while (!EMPTY(&tab[j]))
            j = (j + 1) & (cap - 1);
        tab[j] = *e;
    }
    PyMem_Free(m->tab);
    m->tab = tab;
    m->cap = cap;
    return 0;
}

/* Set key's mask (steals nothing: `wide` is increfed here). */
static int put(OwnerMap *m, uint64_t key, uint64_t low, PyObject *wide) {
    if ((m->used + 1) * 2 > m->cap && resize(m, m->cap * 2) < 0)
        return -1;
    size_t mask = m->cap - 1, i = slot_of(key, m->cap);
    Entry *e;
    for (;;) {
        e = &m->tab[i];
        if (EMPTY(e)) {
            e->key = key;
            m->used++;
            break;
        }
        if (e->key == key) {
            Py_CLEAR(e->wide);
            break;
        }
        i = (i + 1) & mask;
    }
    e->low = low;
    Py_XINCREF(wide);
    e->wide = wide;
    return 0;
}

/* Delete the entry `e` (linear probing's backward shift: no tombstones). */
static void drop(OwnerMap *m, Entry *e) {
    size_t mask = m->cap - 1, i = (size_t)(e - m->tab), j = i;
    Py_CLEAR(e->wide);
    for (;;) {
        j = (j + 1) & mask;
        Entry *f = &m->tab[j];
        if (EMPTY(f))
            break;
        size_t k = slot_of(f->key, m->cap);
        /* f stays when its home k lies cyclically in (i, j] */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            m->tab[i] = *f;
            i = j;
        }
    }
    m->tab[i].low = 0;
    m->tab[i].wide = NULL;
    m->used--;
    if (m->cap > MIN_CAP && m->used * 8 < m->cap)
        (void)resize(m, m->cap / 2);    /* a failed shrink leaves a valid, larger table */
}

/* ---------------------------------------------------------------------------- the mapping */

static OwnerMap *alloc_map(PyTypeObject *type, size_t cap) {
    OwnerMap *m = (OwnerMap *)type->tp_alloc(type, 0);
    if (m == NULL)
        return NULL;
    m->tab = PyMem_Calloc(cap, sizeof(Entry));
    if (m->tab == NULL) {
        Py_DECREF(m);
        PyErr_NoMemory();
        return NULL;
    }
    m->cap = cap;
    return m;
}

static PyObject *om_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "OwnerMap() takes no arguments");
        return NULL;
    }
    return (PyObject *)alloc_map(type, MIN_CAP);
}

static void clear_all(OwnerMap *m) {
    for (size_t i = 0; i < m->cap; i++)
        Py_CLEAR(m->tab[i].wide);
    memset(m->tab, 0, m->cap * sizeof(Entry));
    m->used = 0;
    Py_CLEAR(m->other);
}

static void om_dealloc(OwnerMap *m) {
    if (m->tab != NULL) {
        clear_all(m);
        PyMem_Free(m->tab);
    }
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t om_len(OwnerMap *m) {
    return (Py_ssize_t)m->used + (m->other ? PyDict_GET_SIZE(m->other) : 0);
}

/* The mask of `k` (new reference), NULL with no error set when absent. */
static PyObject *lookup(OwnerMap *m, PyObject *k) {
    uint64_t key;
    int r = u64_of(k, &key);
    if (r < 0)
        return NULL;
    if (r == 0) {
        if (m->other == NULL)
            return NULL;
        PyObject *v = PyDict_GetItemWithError(m->other, k);
        Py_XINCREF(v);
        return v;
    }
    Entry *e = find(m, key);
    return e ? mask_obj(e) : NULL;
}

static PyObject *om_subscript(OwnerMap *m, PyObject *k) {
    PyObject *v = lookup(m, k);
    if (v == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, k);
    return v;
}

static int om_ass(OwnerMap *m, PyObject *k, PyObject *v) {
    uint64_t key;
    int r = u64_of(k, &key);
    if (r < 0)
        return -1;
    if (r == 0) {
        if (v == NULL) {
            if (m->other == NULL) {
                PyErr_SetObject(PyExc_KeyError, k);
                return -1;
            }
            return PyDict_DelItem(m->other, k);
        }
        uint64_t low;
        PyObject *wide;
        if (mask_of(v, &low, &wide) < 0)
            return -1;
        if (m->other == NULL && (m->other = PyDict_New()) == NULL)
            return -1;
        return PyDict_SetItem(m->other, k, v);
    }
    if (v == NULL) {
        Entry *e = find(m, key);
        if (e == NULL) {
            PyErr_SetObject(PyExc_KeyError, k);
            return -1;
        }
        drop(m, e);
        return 0;
    }
    uint64_t low;
    PyObject *wide;
    if (mask_of(v, &low, &wide) < 0)
        return -1;
    return put(m, key, low, wide);
}

static int om_contains(OwnerMap *m, PyObject *k) {
    PyObject *v = lookup(m, k);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_DECREF(v);
    return 1;
}

static PyObject *om_get(OwnerMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get() takes 1 or 2 arguments, found %zd", nargs);
        return NULL;
    }
    PyObject *v = lookup(m, args[0]);
    if (v == NULL && !PyErr_Occurred()) {
        v = nargs == 2 ? args[1] : Py_None;
        Py_INCREF(v);
    }
    return v;
}

/* [(key, mask)] (what=2), [key] (0) or [mask] (1). */
static PyObject *listing(OwnerMap *m, int what) {
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < m->cap; i++) {
        Entry *e = &m->tab[i];
        if (EMPTY(e))
            continue;
        PyObject *k = what != 1 ? PyLong_FromUnsignedLongLong(e->key) : NULL;
        PyObject *v = what != 0 ? mask_obj(e) : NULL;
        PyObject *item = what == 0 ? k : what == 1 ? v : (k && v ? PyTuple_Pack(2, k, v) : NULL);
        if (what == 2) {
            Py_XDECREF(k);
            Py_XDECREF(v);
        }
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    if (m->other != NULL) {
        PyObject *rest = what == 0 ? PyDict_Keys(m->other) : what == 1 ? PyDict_Values(m->other)
                                                                       : PyDict_Items(m->other);
        if (rest == NULL || PyList_SetSlice(out, PyList_GET_SIZE(out), PyList_GET_SIZE(out), rest) < 0) {
            Py_XDECREF(rest);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(rest);
    }
    return out;
}

static PyObject *om_keys(OwnerMap *m, PyObject *unused) { (void)unused; return listing(m, 0); }
static PyObject *om_values(OwnerMap *m, PyObject *unused) { (void)unused; return listing(m, 1); }
static PyObject *om_items(OwnerMap *m, PyObject *unused) { (void)unused; return listing(m, 2); }

static PyObject *om_iter(OwnerMap *m) {
    PyObject *keys = listing(m, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *om_clear(OwnerMap *m, PyObject *unused) {
    (void)unused;
    clear_all(m);
    if (m->cap > MIN_CAP && resize(m, MIN_CAP) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *to_dict(OwnerMap *m) {
    PyObject *d = PyDict_New(), *items = d ? listing(m, 2) : NULL;
    if (items == NULL) {
        Py_XDECREF(d);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        if (PyDict_SetItem(d, PyTuple_GET_ITEM(kv, 0), PyTuple_GET_ITEM(kv, 1)) < 0) {
            Py_DECREF(items);
            Py_DECREF(d);
            return NULL;
        }
    }
    Py_DECREF(items);
    return d;
}

static PyObject *om_copy(OwnerMap *m, PyObject *unused) {
    (void)unused;
    OwnerMap *c = alloc_map(Py_TYPE(m), m->cap);
    if (c == NULL)
        return NULL;
    memcpy(c->tab, m->tab, m->cap * sizeof(Entry));
    c->used = m->used;
    for (size_t i = 0; i < c->cap; i++)
        Py_XINCREF(c->tab[i].wide);
    if (m->other != NULL && (c->other = PyDict_Copy(m->other)) == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static PyObject *om_deepcopy(OwnerMap *m, PyObject *memo) {
    (void)memo;     /* masks are ints: a copy is a deep copy */
    return om_copy(m, NULL);
}

static PyObject *om_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(a, &OwnerMapType)
        || !(PyDict_Check(b) || PyObject_TypeCheck(b, &OwnerMapType)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *da = to_dict((OwnerMap *)a);
    PyObject *db = da == NULL ? NULL : PyDict_Check(b) ? (Py_INCREF(b), b) : to_dict((OwnerMap *)b);
    PyObject *r = db == NULL ? NULL : PyObject_RichCompare(da, db, op);
    Py_XDECREF(da);
    Py_XDECREF(db);
    return r;
}

static PyObject *om_repr(OwnerMap *m) {
    PyObject *d = to_dict(m);
    if (d == NULL)
        return NULL;
    PyObject *r = PyUnicode_FromFormat("OwnerMap(%R)", d);
    Py_DECREF(d);
    return r;
}

/* ---------------------------------------------------------------------------- the walk */

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

#define AHEAD 8     /* keys prefetched ahead of the walk */

/* The u64 walk over keys in a buffer of native u64: every key is a table key. */
static inline uint64_t u64_at(const char *p, Py_ssize_t i) {
    uint64_t k;
    memcpy(&k, p + 8 * i, 8);
    return k;
}

/* One key of the word walk: narrow the active slots `*a` by the key's mask `x`, appending the
 * group of slots that matched exactly `i` keys when some dropped out. 0: go on; 1: no slot is
 * left (the walk ends); -1: error. */
static inline int narrow(PyObject *out, uint64_t *a, uint64_t x, Py_ssize_t i) {
    x &= *a;
    if (x == *a)
        return 0;
    if (group(out, PyLong_FromUnsignedLongLong(*a ^ x), i) == NULL)
        return -1;
    *a = x;
    return x ? 0 : 1;
}

static int walk_buf(OwnerMap *m, const char *keys, Py_ssize_t n, uint64_t a, PyObject *out) {
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        PREFETCH(&m->tab[slot_of(u64_at(keys, i), m->cap)]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            PREFETCH(&m->tab[slot_of(u64_at(keys, i + AHEAD), m->cap)]);
        Entry *e = find(m, u64_at(keys, i));
        int r = narrow(out, &a, e ? e->low : 0, i);
        if (r)
            return r < 0 ? -1 : 0;
    }
    return group(out, PyLong_FromUnsignedLongLong(a), n) == NULL ? -1 : 0;
}

/* The mask of the i-th key of a list as a word (0: absent). */
static int list_low(OwnerMap *m, PyObject *k, uint64_t *x) {
    uint64_t key;
    int r = u64_of(k, &key);
    if (r < 0)
        return -1;
    if (r) {
        Entry *e = find(m, key);
        *x = e ? e->low : 0;
        return 0;
    }
    PyObject *v = m->other ? PyDict_GetItemWithError(m->other, k) : NULL;
    if (v == NULL) {
        *x = 0;
        return PyErr_Occurred() ? -1 : 0;
    }
    *x = PyLong_AsUnsignedLongLongMask(v);
    return *x == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

static int walk_list(OwnerMap *m, PyObject *keys, uint64_t a, PyObject *out) {
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t x;
        if (list_low(m, PyList_GET_ITEM(keys, i), &x) < 0)
            return -1;
        int r = narrow(out, &a, x, i);
        if (r)
            return r < 0 ? -1 : 0;
    }
    return group(out, PyLong_FromUnsignedLongLong(a), n) == NULL ? -1 : 0;
}

/* More slots than a word holds: the same loop on Python ints. */
static int walk_wide(OwnerMap *m, PyObject *keys, PyObject *active, PyObject *out) {
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *a = active;
    Py_INCREF(a);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = lookup(m, PyList_GET_ITEM(keys, i));
        if (o == NULL && PyErr_Occurred())
            goto fail;
        PyObject *x = o != NULL ? PyNumber_And(a, o) : PyLong_FromLong(0);
        Py_XDECREF(o);
        if (x == NULL)
            goto fail;
        int same = PyObject_RichCompareBool(x, a, Py_EQ);
        if (same < 0) {
            Py_DECREF(x);
            goto fail;
        }
        if (same) {
            Py_DECREF(x);
            continue;
        }
        if (group(out, PyNumber_Xor(a, x), i) == NULL) {
            Py_DECREF(x);
            goto fail;
        }
        int nz = PyObject_IsTrue(x);
        Py_DECREF(a);
        a = x;
        if (nz < 0)
            goto fail;
        if (!nz) {
            Py_DECREF(a);
            return 0;
        }
    }
    return group(out, a, n) == NULL ? -1 : 0;     /* steals a */
fail:
    Py_DECREF(a);
    return -1;
}

PyDoc_STRVAR(walk_doc,
"walk(keys, active) -> [(bits, depth)]\n\n"
"`m = active`; for the i-th key, `x = m & self.get(key, 0)`: when `x != m`, append\n"
"`(m ^ x, i)` (those slots matched exactly i keys), stop at `x == 0`, else `m = x`. At the\n"
"end, append `(m, len(keys))`. `keys` is a list of ints, or bytes of native u64.");

static PyObject *om_walk(OwnerMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_check("walk", nargs, 2) < 0)
        return NULL;
    PyObject *keys = args[0], *active = args[1];
    int is_bytes = PyBytes_Check(keys);
    if (!(is_bytes || PyList_Check(keys)) || !PyLong_Check(active)) {
        PyErr_Format(PyExc_TypeError, "walk(list or bytes, int) expected, found (%.100s, %.100s)",
                     Py_TYPE(keys)->tp_name, Py_TYPE(active)->tp_name);
        return NULL;
    }
    if (is_bytes && PyBytes_GET_SIZE(keys) % 8) {
        PyErr_Format(PyExc_ValueError, "walk() keys as bytes are native u64: a multiple of 8 bytes, "
                     "found %zd", PyBytes_GET_SIZE(keys));
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    int rc;
    uint64_t a;
    int w = u64_of(active, &a);     /* 1: a machine word; 0: more than 64 slots (or negative) */
    if (w > 0) {
        if (is_bytes) {
            rc = walk_buf(m, PyBytes_AS_STRING(keys), PyBytes_GET_SIZE(keys) / 8, a, out);
        } else {
            rc = walk_list(m, keys, a, out);
        }
    } else if (w == 0) {    /* Python ints */
        PyObject *lst = is_bytes ? NULL : (Py_INCREF(keys), keys);
        if (is_bytes) {
            Py_ssize_t n = PyBytes_GET_SIZE(keys) / 8;
            const char *buf = PyBytes_AS_STRING(keys);
            lst = PyList_New(n);
            for (Py_ssize_t i = 0; lst != NULL && i < n; i++) {
                PyObject *k = PyLong_FromUnsignedLongLong(u64_at(buf, i));
                if (k == NULL)
                    Py_CLEAR(lst);
                else
                    PyList_SET_ITEM(lst, i, k);
            }
        }
        rc = lst == NULL ? -1 : walk_wide(m, lst, active, out);
        Py_XDECREF(lst);
    } else {
        rc = -1;
    }
    if (rc < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* ---------------------------------------------------------------------------- speculation */

/* Set `bit` in self[ck] (a new entry when absent); 1 when it was set already, 0 when not, -1 on
 * error. */
static int generic_add(OwnerMap *m, PyObject *ck, PyObject *bit) {
    PyObject *o = lookup(m, ck);
    if (o == NULL)
        return PyErr_Occurred() ? -1 : om_ass(m, ck, bit);
    PyObject *a = PyNumber_And(o, bit);
    int has = a == NULL ? -1 : PyObject_IsTrue(a);
    Py_XDECREF(a);
    if (has == 0) {
        PyObject *nm = PyNumber_Or(o, bit);
        has = nm == NULL ? -1 : om_ass(m, ck, nm);
        Py_XDECREF(nm);
    }
    Py_DECREF(o);
    return has;
}

/* Clear `bit` in self[ck] (the entry deleted at 0); a KeyError when ck has no entry (the index's
 * invariant: a predicted key has owners). 0 on success. */
static int generic_clear(OwnerMap *m, PyObject *ck, PyObject *bit) {
    PyObject *o = lookup(m, ck);
    if (o == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, ck);
        return -1;
    }
    PyObject *inv = PyNumber_Invert(bit), *nm = inv ? PyNumber_And(o, inv) : NULL;
    Py_DECREF(o);
    Py_XDECREF(inv);
    if (nm == NULL)
        return -1;
    int nz = PyObject_IsTrue(nm);
    int rc = nz < 0 ? -1 : om_ass(m, ck, nz ? nm : NULL);
    Py_DECREF(nm);
    return rc;
}

PyDoc_STRVAR(spec_add_doc,
"spec_add(keys, owned, spec, bit, deadline, log) -> list of the keys given the deadline\n\n"
"For each key: skip it when the slot holds it (`bit` set in `self[key]` and the key in\n"
"`owned`); else set `spec[key] = deadline` and, when `bit` was not set, set it in `self[key]`\n"
"(a new entry when absent) and append the key to `log` (an owner-mask change). A key the slot\n"
"already predicts only gets the new deadline: its mask does not change, so it is not logged.");

static PyObject *om_spec_add(OwnerMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_check("spec_add", nargs, 6) < 0)
        return NULL;
    PyObject *keys = args[0], *owned = args[1], *spec = args[2], *bit = args[3];
    PyObject *deadline = args[4], *log = args[5];
    if (!PyList_Check(keys) || !PyDict_Check(owned) || !PyDict_Check(spec) || !PyLong_Check(bit)
        || !PyList_Check(log)) {
        PyErr_SetString(PyExc_TypeError, "spec_add(list, dict, dict, int, deadline, list) expected");
        return NULL;
    }
    uint64_t b;
    int word = u64_of(bit, &b);     /* 0: a slot bit past 63 (Python ints below) */
    if (word < 0)
        return NULL;
    PyObject *added = PyList_New(0);
    if (added == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ck = PyList_GET_ITEM(keys, i);
        uint64_t key;
        int r = u64_of(ck, &key);
        if (r < 0)
            goto fail;
        int has_bit, held;
        Entry *e = r && word ? find(m, key) : NULL;
        if (r && word && (e == NULL || e->wide == NULL)) {
            has_bit = e != NULL && (e->low & b);
            if (!has_bit) {
                if (e != NULL)
                    e->low |= b;
                else if (put(m, key, b, NULL) < 0)
                    goto fail;
            }
        } else {    /* a key that is not u64, a wide mask or a slot bit past 63: Python ints */
            has_bit = generic_add(m, ck, bit);
            if (has_bit < 0)
                goto fail;
        }
        if (has_bit) {
            held = PyDict_Contains(owned, ck);
            if (held < 0)
                goto fail;
            if (held)
                continue;
        } else if (PyList_Append(log, ck) < 0) {
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

PyDoc_STRVAR(spec_expire_doc,
"spec_expire(keys, spec, log, bit, now) -> how many keys expired\n\n"
"For each key whose `spec` deadline is <= `now`: delete it from `spec`, append it to `log`, and\n"
"clear `bit` in `self[key]` (the entry deleted at 0).");

static PyObject *om_spec_expire(OwnerMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_check("spec_expire", nargs, 5) < 0)
        return NULL;
    PyObject *keys = args[0], *spec = args[1], *log = args[2], *bit = args[3], *now_o = args[4];
    if (!PyTuple_Check(keys) || !PyDict_Check(spec) || !PyList_Check(log) || !PyLong_Check(bit)) {
        PyErr_SetString(PyExc_TypeError, "spec_expire(tuple, dict, list, int, now) expected");
        return NULL;
    }
    double now = PyFloat_AsDouble(now_o);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    uint64_t b;
    int word = u64_of(bit, &b);     /* 0: a slot bit past 63 (Python ints below) */
    if (word < 0)
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
        uint64_t key;
        int r = u64_of(ck, &key);
        if (r < 0)
            return NULL;
        Entry *e = r && word ? find(m, key) : NULL;
        if (e != NULL && e->wide == NULL) {
            if (e->low & ~b)
                e->low &= ~b;
            else
                drop(m, e);
        } else if (generic_clear(m, ck, bit) < 0) {
            return NULL;
        }
        done++;
    }
    return PyLong_FromSsize_t(done);
}

/* ---------------------------------------------------------------------- cache-age stamps */
/* The same table holds a slot's cache-age stamps for router/kv_capacity.py (a table of its own per
 * slot): key -> AGE_OFFSET + stamp, where a stamp is a signed clock value (the offset keeps every
 * stored word positive, so an entry is never empty). `age_stamp` and `age_cut` are
 * `CapacityBound.stamp`'s and `.cut`'s per-key loops; kv_capacity.py's `_stamp_py` and `_cut_py`
 * are the same recipes over a dict of plain stamps. */

#define AGE_OFFSET ((int64_t)1 << 62)

/* The u64 keys of a buffer (bytes, a contiguous uint64 array). 0 on success. */
static int age_keys(PyObject *keys, Py_buffer *view) {
    if (PyObject_GetBuffer(keys, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % 8) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "keys are u64 (8 bytes each), found %zd bytes", view->len);
        return -1;
    }
    return 0;
}

/* The stamp of `key` in *st: 1 when it has one, 0 when not. */
static inline int age_of(OwnerMap *m, uint64_t key, int64_t *st) {
    Entry *e = find(m, key);
    if (e == NULL || e->wide != NULL)
        return 0;
    *st = (int64_t)e->low - AGE_OFFSET;
    return 1;
}

static inline int age_put(OwnerMap *m, uint64_t key, int64_t v) {
    return put(m, key, (uint64_t)(v + AGE_OFFSET), NULL);
}

PyDoc_STRVAR(age_stamp_doc,
"age_stamp(keys, stride, clock, have, young) -> the last key's stamp, or None (no keys)\n\n"
"Stamp a prompt's chain `keys` (u64 buffer) used at `clock`: position i gets clock - i, at every\n"
"`stride`-th position (stride - 1, 2 * stride - 1, ...) and the last. Positions before `have`\n"
"are skipped when the deepest stride position among them was stamped less than `young` ticks\n"
"ago (its stamp + position > clock - young).");

static PyObject *om_age_stamp(OwnerMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_check("age_stamp", nargs, 5) < 0)
        return NULL;
    Py_ssize_t stride = PyLong_AsSsize_t(args[1]);
    long long clock = PyLong_AsLongLong(args[2]);
    Py_ssize_t have = PyLong_AsSsize_t(args[3]);
    long long young = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (stride < 1) {
        PyErr_Format(PyExc_ValueError, "stride must be >= 1, found %zd", stride);
        return NULL;
    }
    Py_buffer view;
    if (age_keys(args[0], &view) < 0)
        return NULL;
    const char *keys = view.buf;
    Py_ssize_t n = view.len / 8;
    PyObject *res = NULL;
    if (n == 0) {
        res = Py_None;
        Py_INCREF(res);
        goto done;
    }
    int64_t last_v = (int64_t)clock - (n - 1), st;
    Py_ssize_t start = stride - 1;
    if (have > stride && have <= n) {
        Py_ssize_t p = (have / stride) * stride - 1;
        if (age_of(m, u64_at(keys, p), &st) && (int64_t)clock - (st + p) < young)
            start = p + stride;
    }
    for (Py_ssize_t i = start; i < n; i += stride)
        if (age_put(m, u64_at(keys, i), (int64_t)clock - i) < 0)
            goto done;
    if (age_put(m, u64_at(keys, n - 1), last_v) < 0)
        goto done;
    res = PyLong_FromLongLong(last_v);
done:
    PyBuffer_Release(&view);
    return res;
}

PyDoc_STRVAR(age_cut_doc,
"age_cut(keys, depth, limit, stride, scan) -> the alive part of a depth-key match\n\n"
"`depth` when the stamp of keys[depth - 1] is above `limit` (or, unstamped, the deepest stamped\n"
"stride position of the `scan` before it, less its distance; no stamp there: `depth`); else the\n"
"deepest alive stride position found by bisection (an unstamped one counts as alive), the count\n"
"read off the dead stamp after it (q + stamp - limit), at least through the alive one.");

static PyObject *om_age_cut(OwnerMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_check("age_cut", nargs, 5) < 0)
        return NULL;
    Py_ssize_t depth = PyLong_AsSsize_t(args[1]);
    long long limit = PyLong_AsLongLong(args[2]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[3]);
    Py_ssize_t scan = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (age_keys(args[0], &view) < 0)
        return NULL;
    const char *keys = view.buf;
    Py_ssize_t n = view.len / 8, res;
    if (depth < 1 || depth > n || stride < 1) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "age_cut: expected 1 <= depth <= %zd keys and stride >= 1, "
                     "found depth %zd, stride %zd", n, depth, stride);
        return NULL;
    }
    Py_ssize_t q = depth - 1, hi, lo = -1;
    int64_t sq, st;
    if (!age_of(m, u64_at(keys, q), &sq)) {
        Py_ssize_t j = depth / stride - 1, stop = j - scan < -1 ? -1 : j - scan;
        int found = 0;
        for (; j > stop; j--)
            if ((found = age_of(m, u64_at(keys, j * stride + stride - 1), &sq)))
                break;
        if (!found) {
            res = depth;
            goto done;
        }
        q = j * stride + stride - 1;
        if (sq > limit) {
            res = q + (Py_ssize_t)(sq - limit);
            if (res > depth)
                res = depth;
            goto done;
        }
        hi = j;
    } else if (sq > limit) {
        res = depth;
        goto done;
    } else {
        hi = depth / stride;
    }
    while (hi - lo > 1) {
        Py_ssize_t mid = (lo + hi) >> 1, pos = mid * stride + stride - 1;
        if (!age_of(m, u64_at(keys, pos), &st) || st > limit) {
            lo = mid;
        } else {
            hi = mid;
            q = pos;
            sq = st;
        }
    }
    res = q + (Py_ssize_t)(sq - limit);
    if (lo >= 0 && res < lo * stride + stride)
        res = lo * stride + stride;
    if (res < 0)
        res = 0;
done:
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(res);
}

/* ---------------------------------------------------------------------------- the type */

static PyMappingMethods om_as_mapping = {
    (lenfunc)om_len, (binaryfunc)om_subscript, (objobjargproc)om_ass,
};

static PySequenceMethods om_as_sequence = {
    .sq_contains = (objobjproc)om_contains,
};

static PyMethodDef om_methods[] = {
    {"get", (PyCFunction)(void (*)(void))om_get, METH_FASTCALL, "get(key, default=None)"},
    {"keys", (PyCFunction)om_keys, METH_NOARGS, "A list of the keys."},
    {"values", (PyCFunction)om_values, METH_NOARGS, "A list of the masks."},
    {"items", (PyCFunction)om_items, METH_NOARGS, "A list of (key, mask)."},
    {"clear", (PyCFunction)om_clear, METH_NOARGS, "Remove every key."},
    {"copy", (PyCFunction)om_copy, METH_NOARGS, "A copy."},
    {"__copy__", (PyCFunction)om_copy, METH_NOARGS, "A copy."},
    {"__deepcopy__", (PyCFunction)om_deepcopy, METH_O, "A copy (masks are ints)."},
    {"walk", (PyCFunction)(void (*)(void))om_walk, METH_FASTCALL, walk_doc},
    {"spec_add", (PyCFunction)(void (*)(void))om_spec_add, METH_FASTCALL, spec_add_doc},
    {"spec_expire", (PyCFunction)(void (*)(void))om_spec_expire, METH_FASTCALL, spec_expire_doc},
    {"age_stamp", (PyCFunction)(void (*)(void))om_age_stamp, METH_FASTCALL, age_stamp_doc},
    {"age_cut", (PyCFunction)(void (*)(void))om_age_cut, METH_FASTCALL, age_cut_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject OwnerMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "router._owner_map.OwnerMap",
    .tp_basicsize = sizeof(OwnerMap),
    .tp_dealloc = (destructor)om_dealloc,
    .tp_repr = (reprfunc)om_repr,
    .tp_as_sequence = &om_as_sequence,
    .tp_as_mapping = &om_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "OwnerMap(): canonical block key -> positive slot mask (router/_owner_map.c).",
    .tp_richcompare = om_richcompare,
    .tp_iter = (getiterfunc)om_iter,
    .tp_methods = om_methods,
    .tp_new = om_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._owner_map",
    "The KV index's owner masks and its per-key loops (router/kv_index.py); see router/_owner_map.c.",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__owner_map(void) {
    PyObject *os = PyImport_ImportModule("os");
    PyObject *raw = os ? PyObject_CallMethod(os, "urandom", "i", 8) : NULL;
    Py_XDECREF(os);
    if (raw == NULL)
        return NULL;
    memcpy(&seed, PyBytes_AS_STRING(raw), sizeof seed);
    Py_DECREF(raw);
    if (zero == NULL && (zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    if (PyType_Ready(&OwnerMapType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&OwnerMapType);
    if (PyModule_AddObject(mod, "OwnerMap", (PyObject *)&OwnerMapType) < 0) {
        Py_DECREF(&OwnerMapType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
