/* Canonical block keys in one native call: router/block_keys.py's `xxh3_chain_v1` recipe.
 *
 * Why native: the recipe is two XXH3-64 calls per block (the block's local hash, then the chain
 * step over the parent key and that hash), and the chain is sequential. From Python that is two
 * library calls, a struct pack and the loop's bytecode per block: ~22 us for the fleet's 60-block
 * prompt, half of a kv_cache_aware request's extra CPU in a fleet process (bench/RESULTS.md, "fleet
 * CPU per request · native block keys"). Here it is one pass over the token ids.
 *
 * XXH3-64 with a seed and the default secret, for inputs of 0..240 bytes: the short and mid-size
 * paths of xxhash.h (v0.8), the same structure as router/block_keys.py's numpy version. Longer
 * blocks (over 60 tokens) are not handled here: the Python module keeps its own path for them.
 * tests/router/test_block_keys_native.py checks every length 0..240 against the xxhash library
 * and the keys against the pure-Python recipe.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_args.h"

static const uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME_MX1 0x165667919E3779F9ULL
#define PRIME_MX2 0x9FB21C651E98DF25ULL
#define MAX_BYTES 240

/* Little-endian loads and stores (the recipe's byte order) on any host. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LE32(v) __builtin_bswap32(v)
#define LE64(v) __builtin_bswap64(v)
#else
#define LE32(v) (v)
#define LE64(v) (v)
#endif

static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return LE64(v); }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return LE32(v); }
static inline void wr32(uint8_t *p, uint32_t v) { v = LE32(v); memcpy(p, &v, 4); }
static inline void wr64(uint8_t *p, uint64_t v) { v = LE64(v); memcpy(p, &v, 8); }

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fold64(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PRIME_MX1;
    return h ^ (h >> 32);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= PRIME64_2;
    h ^= h >> 29;
    h *= PRIME64_3;
    return h ^ (h >> 32);
}

static inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PRIME_MX2;
    h ^= (h >> 35) + len;
    h *= PRIME_MX2;
    return h ^ (h >> 28);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *sec, uint64_t seed) {
    return fold64(rd64(in) ^ (rd64(sec) + seed), rd64(in + 8) ^ (rd64(sec + 8) - seed));
}

/* XXH3_64bits_withSeed(in, len, seed) for len <= MAX_BYTES. */
static uint64_t xxh3_64(const uint8_t *in, size_t len, uint64_t seed) {
    const uint8_t *s = kSecret;
    if (len <= 16) {
        if (len > 8) {
            uint64_t lo = rd64(in) ^ ((rd64(s + 24) ^ rd64(s + 32)) + seed);
            uint64_t hi = rd64(in + len - 8) ^ ((rd64(s + 40) ^ rd64(s + 48)) - seed);
            return avalanche(len + __builtin_bswap64(lo) + hi + fold64(lo, hi));
        }
        if (len >= 4) {
            uint64_t sd = seed ^ ((uint64_t)__builtin_bswap32((uint32_t)seed) << 32);
            uint64_t in64 = rd32(in + len - 4) + ((uint64_t)rd32(in) << 32);
            return rrmxmx(in64 ^ ((rd64(s + 8) ^ rd64(s + 16)) - sd), len);
        }
        if (len > 0) {
            uint32_t c = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24)
                         | (uint32_t)in[len - 1] | ((uint32_t)len << 8);
            return xxh64_avalanche((uint64_t)c ^ ((uint64_t)(rd32(s) ^ rd32(s + 4)) + seed));
        }
        return xxh64_avalanche(seed ^ (rd64(s + 56) ^ rd64(s + 64)));
    }
    uint64_t acc = (uint64_t)len * PRIME64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(in + 48, s + 96, seed);
                    acc += mix16(in + len - 64, s + 112, seed);
                }
                acc += mix16(in + 32, s + 64, seed);
                acc += mix16(in + len - 48, s + 80, seed);
            }
            acc += mix16(in + 16, s + 32, seed);
            acc += mix16(in + len - 32, s + 48, seed);
        }
        acc += mix16(in, s, seed);
        acc += mix16(in + len - 16, s + 16, seed);
        return avalanche(acc);
    }
    /* 129..240 bytes */
    unsigned rounds = (unsigned)(len / 16), i;
    for (i = 0; i < 8; i++)
        acc += mix16(in + 16 * i, s + 16 * i, seed);
    uint64_t acc_end = mix16(in + len - 16, s + 136 - 17, seed);
    acc = avalanche(acc);
    for (i = 8; i < rounds; i++)
        acc_end += mix16(in + 16 * i, s + 16 * (i - 8) + 3, seed);
    return avalanche(acc + acc_end);
}

/* A token id (an item of a list or tuple) as u32; -1 with ValueError set when it is not one. */
static int token_u32(PyObject *item, uint32_t *out) {
    /* the common case first, without the generic conversion: an int of one machine word */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(item) && PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (v >= 0 && (uint64_t)v <= 0xFFFFFFFFULL) {
            *out = (uint32_t)v;
            return 0;
        }
    }
#else
    if (PyLong_CheckExact(item) && Py_SIZE(item) >= 0 && Py_SIZE(item) <= 1) {
        *out = Py_SIZE(item) ? (uint32_t)((PyLongObject *)item)->ob_digit[0] : 0;
        return 0;
    }
#endif
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_ValueError, "token ids must be a sequence of ints: found %.80s",
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
        PyErr_Format(PyExc_ValueError, "token ids must be in [0, 2**32): found %R", item);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

PyDoc_STRVAR(chain_doc,
"chain(token_ids, block_size, seed, parent, as_list) -> bytes | list[int]\n\n"
"Canonical keys of the full blocks of `token_ids` (a list or tuple of ints, or a C-contiguous\n"
"buffer of little-endian u32): each block's XXH3-64 under `seed`, chained from `parent` (None:\n"
"the root) with XXH3-64 under 1337 over u64le(previous key) || u64le(local hash). Returns the\n"
"keys as little-endian u64 bytes, or as a list of ints when `as_list` is true. Only the ids of\n"
"full blocks are read and range-checked. `block_size` must be 1..60.");

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_check("chain", nargs, 5) < 0)
        return NULL;
    PyObject *toks = args[0];
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    if (bs <= 0 || bs * 4 > MAX_BYTES) {
        PyErr_Format(PyExc_ValueError, "block_size must be 1..%d tokens here, found %zd",
                     MAX_BYTES / 4, bs);
        return NULL;
    }
    uint64_t seed = PyLong_AsUnsignedLongLongMask(args[2]);
    if (seed == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    int has_parent = args[3] != Py_None;
    uint64_t prev = 0;
    if (has_parent) {
        prev = PyLong_AsUnsignedLongLongMask(args[3]);
        if (prev == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    int as_list = PyObject_IsTrue(args[4]);
    if (as_list < 0)
        return NULL;

    Py_buffer view = {0};
    PyObject **items = NULL;
    Py_ssize_t ntok;
    if (PyList_CheckExact(toks) || PyTuple_CheckExact(toks)) {
        ntok = PySequence_Fast_GET_SIZE(toks);
        items = PySequence_Fast_ITEMS(toks);
    } else {
        if (PyObject_GetBuffer(toks, &view, PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "token ids must be a list or tuple of ints or a buffer of "
                         "u32, found %.80s", Py_TYPE(toks)->tp_name);
            return NULL;
        }
        if (view.len % 4) {
            PyErr_Format(PyExc_ValueError, "a token buffer must hold u32 ids: %zd bytes is not a "
                         "multiple of 4", view.len);
            PyBuffer_Release(&view);
            return NULL;
        }
        ntok = view.len / 4;
    }
    Py_ssize_t n = ntok / bs;
    PyObject *out = as_list ? PyList_New(n) : PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL)
        goto fail;
    uint8_t *dst = as_list ? NULL : (uint8_t *)PyBytes_AS_STRING(out);
    uint8_t block[MAX_BYTES], pair[16];
    size_t step = (size_t)bs * 4;
    for (Py_ssize_t b = 0; b < n; b++) {
        const uint8_t *src;
        if (items != NULL) {
            /* the items are read while no Python code runs: the list cannot change under us */
            PyObject **it = items + b * bs;
            for (Py_ssize_t j = 0; j < bs; j++) {
                uint32_t v;
                if (token_u32(it[j], &v) < 0)
                    goto fail;
                wr32(block + 4 * j, v);
            }
            src = block;
        } else {
            src = (const uint8_t *)view.buf + b * step;
        }
        uint64_t local = xxh3_64(src, step, seed);
        uint64_t key;
        if (b == 0 && !has_parent) {
            key = local;
        } else {
            wr64(pair, prev);
            wr64(pair + 8, local);
            key = xxh3_64(pair, 16, 1337);
        }
        prev = key;
        if (as_list) {
            PyObject *k = PyLong_FromUnsignedLongLong(key);
            if (k == NULL)
                goto fail;
            PyList_SET_ITEM(out, b, k);
        } else {
            wr64(dst + 8 * b, key);
        }
    }
    if (items == NULL)
        PyBuffer_Release(&view);
    return out;
fail:
    Py_XDECREF(out);
    if (items == NULL && view.obj != NULL)
        PyBuffer_Release(&view);
    return NULL;
}

PyDoc_STRVAR(xxh3_doc, "xxh3_64(data, seed) -> int: XXH3-64 of up to 240 bytes (for the tests).");

static PyObject *py_xxh3(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    if (nargs_check("xxh3_64", nargs, 2) < 0)
        return NULL;
    uint64_t seed = PyLong_AsUnsignedLongLongMask(args[1]);
    if (seed == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (view.len > MAX_BYTES) {
        PyErr_Format(PyExc_ValueError, "at most %d bytes, found %zd", MAX_BYTES, view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t h = xxh3_64((const uint8_t *)view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, chain_doc},
    {"xxh3_64", (PyCFunction)(void (*)(void))py_xxh3, METH_FASTCALL, xxh3_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._chain",
    "Native canonical block keys (router/block_keys.py's recipe); see router/_chain.c.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__chain(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_BLOCK_SIZE", MAX_BYTES / 4) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
