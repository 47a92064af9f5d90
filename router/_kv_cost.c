/* The numeric cores of `kv_cache_aware` placement, each in one native call: router/policy_kv.py's
 * `_time_core` (`time_core`, the default cost: estimated time to first token) and `_core`
 * (`core`, the token-weight cost), the same numbers in the same order.
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
 * Both end in `decide` (hot servers, ties, the answer tuple): one rule, one place.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include "_args.h"

/* (0, 0): the load `time_core_table` reads for a server absent from the lease table's map
 * (shared, as `LeaseTable.loads_for`'s). */
static PyObject *zero_load = NULL;

/* Per-server scratch arrays live on the stack up to this many candidates (malloc'd beyond). */
#define SMALL_N 64

/* An int argument or a load field as a C long long; -1 with an exception set on failure. The
 * values read per candidate (loads, phases, matches: six per server) are nearly always ints of
 * one digit, read in place: PyLong_AsLongLong's call and checks were a tenth of a placement's
 * native time. */
static inline int as_ll(PyObject *o, long long *out, const char *what) {
    if (PyLong_CheckExact(o)) {
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 0;
        }
#else
        Py_ssize_t size = Py_SIZE(o);
        if (size == 0) {
            *out = 0;
            return 0;
        }
        if (size == 1 || size == -1) {
            *out = (long long)size * (long long)((PyLongObject *)o)->ob_digit[0];
            return 0;
        }
#endif
    }
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

static int as_pair(PyObject *ld, long long *a, long long *b, const char *what) {
    PyObject *x, *y;
    if (PyTuple_Check(ld) && PyTuple_GET_SIZE(ld) == 2) {
        x = PyTuple_GET_ITEM(ld, 0);
        y = PyTuple_GET_ITEM(ld, 1);
    } else if (PyList_Check(ld) && PyList_GET_SIZE(ld) == 2) {
        x = PyList_GET_ITEM(ld, 0);
        y = PyList_GET_ITEM(ld, 1);
    } else {
        PyErr_Format(PyExc_TypeError, "%s must be a (requests, tokens) pair", what);
        return -1;
    }
    return (as_ll(x, a, "a load's requests") || as_ll(y, b, "a load's tokens")) ? -1 : 0;
}

/* A server's reported match in tokens: md[server] * B capped at cap (0 when absent or md None). */
static int match_of(PyObject *mdict, PyObject *server, long long B, long long cap, long long *out) {
    long long mt = 0;
    if (mdict != Py_None) {
        PyObject *v = PyDict_GetItemWithError(mdict, server);
        if (v == NULL && PyErr_Occurred())
            return -1;
        if (v != NULL) {
            if (as_ll(v, &mt, "a matched block count"))
                return -1;
            mt *= B;
        }
    }
    if (!(mt < cap))    /* `mt if mt < cap else cap` */
        mt = cap;
    *out = mt;
    return 0;
}

/* Hot servers, ties and the answer tuple from the costs `cv`, each server's hot-spot load `hv`
 * (in-flight requests for `core`, estimated wait for `time_core`) and requests `req`; steals
 * `matched`. The answer has `nextra` more items after the six, left NULL for the caller to set.
 * The Python side: the end of `_core` / `_time_core`. */
static PyObject *decide(Py_ssize_t n, PyObject *matched, const double *cv, const double *hv,
                        const long long *req, double hf, double slack, long long mbs, double lcap,
                        const char *full, Py_ssize_t nextra) {
    PyObject *costs = NULL, *tied = NULL, *hs = NULL, *lc = NULL, *ans = NULL;
    char hot_small[SMALL_N];
    char *hot = n <= SMALL_N ? hot_small : PyMem_Malloc(n);
    if (hot == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    memset(hot, 0, n);
    costs = PyList_New(n);
    hs = PyList_New(0);
    lc = PyList_New(0);
    if (costs == NULL || hs == NULL || lc == NULL)
        goto fail;
    /* hot: the hotspot rule first, then the load cap for the others (the Python dict's order) */
    Py_ssize_t n_hot = 0;
    double limit = 0.0;
    if (hf != 0.0) {
        double sum = 0.0, maxh = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) {
            sum += hv[i];
            if (i == 0 || hv[i] > maxh)
                maxh = hv[i];
        }
        limit = hf * sum / (double)n + slack;
        if (maxh > limit) {
            for (Py_ssize_t i = 0; i < n; i++) {
                if (hv[i] > limit) {
                    if (append_index(hs, i) < 0)
                        goto fail;
                    hot[i] = 1;
                    n_hot++;
                }
            }
        }
    }
    if (mbs != 0 || full != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!hot[i] && ((full != NULL && full[i]) ||
                            (mbs != 0 && (double)req[i] / (double)mbs >= lcap))) {
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
    if (lim == NULL || (ans = PyTuple_New(6 + nextra)) == NULL) {
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
    if (hot != hot_small)
        PyMem_Free(hot);
    return ans;
}

static int check_lists(PyObject *servers, PyObject *mdict, PyObject *loads, Py_ssize_t *n) {
    if (!PyList_Check(servers) || !PyList_Check(loads)) {
        PyErr_SetString(PyExc_TypeError, "servers and loads must be lists");
        return -1;
    }
    if (mdict != Py_None && !PyDict_Check(mdict)) {
        PyErr_SetString(PyExc_TypeError, "matched must be a dict or None");
        return -1;
    }
    *n = PyList_GET_SIZE(servers);
    if (*n < 1 || PyList_GET_SIZE(loads) != *n) {
        PyErr_Format(PyExc_ValueError, "expected one load per server and at least one server, "
                     "found %zd servers and %zd loads", *n, PyList_GET_SIZE(loads));
        return -1;
    }
    return 0;
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
    if (nargs_check("core", nargs, N_ARGS) < 0)
        return NULL;
    PyObject *servers = args[A_SERVERS], *mdict = args[A_MATCHED], *loads = args[A_LOADS];
    Py_ssize_t n;
    if (check_lists(servers, mdict, loads, &n))
        return NULL;
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

    PyObject *matched = NULL, *ans = NULL;
    double *cv = PyMem_Malloc(n * sizeof(double)), *hv = PyMem_Malloc(n * sizeof(double));
    long long *req = PyMem_Malloc(n * sizeof(long long));
    if (cv == NULL || hv == NULL || req == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if ((matched = PyList_New(n)) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long mt, r, tok;
        if (match_of(mdict, PyList_GET_ITEM(servers, i), B, cap, &mt) ||
            as_pair(PyList_GET_ITEM(loads, i), &r, &tok, "a load"))
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
        hv[i] = (double)r;
    }
    if (pin >= 0 && pin < n)
        cv[pin] -= bonus * (double)nt;
    ans = decide(n, matched, cv, hv, req, hf, slack, mbs, lcap, NULL, 0);
    matched = NULL;
fail:
    Py_XDECREF(matched);
    PyMem_Free(cv);
    PyMem_Free(hv);
    PyMem_Free(req);
    return ans;
}

PyDoc_STRVAR(time_core_doc,
"time_core(servers, matched, loads, phases, params, block_size, cap, num_tokens,\n"
"          uncached_weight, decode_weight, pinned, affinity_bonus, hotspot_factor,\n"
"          hotspot_slack_s, max_batch_size, load_cap, affinity_div)\n"
"    -> (matched_tokens, costs, tied, hotspot, load_capped, limit)\n\n"
"router/policy_kv.py `_time_core` (its docstring has the arguments and the answer).");

PyDoc_STRVAR(time_core_table_doc,
"time_core_table(servers, matched, states, positions, params, block_size, cap, num_tokens,\n"
"                uncached_weight, decode_weight, pinned, affinity_bonus, hotspot_factor,\n"
"                hotspot_slack_s, max_batch_size, load_cap, affinity_div, cursor)\n"
"    -> (matched_tokens, costs, tied, hotspot, load_capped, limit, loads, pick, predicted_s)\n\n"
"`time_core` reading the lease table's own map, `states` (router/leases.py\n"
"`LeaseTable.states`: server -> ((requests, tokens), queued prefill tokens, leases in prefill,\n"
"their tokens[, held KV tokens]), absent: no lease), for the loads and phases, and `matched` through `positions`\n"
"(server -> its index in `servers`): one dict probe per candidate and one per matched server\n"
"instead of lists built per placement. The same numbers, the (requests, tokens) it read per\n"
"server (`loads`), the pick (`tied[cursor % len(tied)]`, the policy's turn among ties) and its\n"
"estimated time to first token (router/policy_kv.py `_predicted_s`).");

enum { T_SERVERS, T_MATCHED, T_LOADS, T_PHASES, T_PARAMS, T_BS, T_CAP, T_NT, T_UW,
       T_DW, T_PIN, T_BONUS, T_HF, T_SLACK, T_MBS, T_LCAP, T_DIV, T_N_ARGS };
/* time_core_table's: the same but for these two, and one more */
enum { T_STATES = T_LOADS, T_POSITIONS = T_PHASES, T_CURSOR = T_N_ARGS };
/* per server in `params` (a buffer of doubles, router/policy_kv.py PARAMS): prefill s/token,
 * chunk tokens, decode s/step, s/request, s/context token, KV capacity tokens, learned scale */
enum { P_A, P_CHUNK, P_S0, P_S1, P_S2, P_KVCAP, P_K, N_PARAMS };

/* A sequence item of `k` or `k + 1` elements (a tuple or a list), its length in `*len`; NULL
 * with TypeError otherwise (a lease state or phase with or without its held KV tokens). */
static PyObject *const *items_of_opt(PyObject *o, Py_ssize_t k, Py_ssize_t *len, const char *what) {
    if (PyTuple_Check(o) && (PyTuple_GET_SIZE(o) == k || PyTuple_GET_SIZE(o) == k + 1)) {
        *len = PyTuple_GET_SIZE(o);
        return &PyTuple_GET_ITEM(o, 0);
    }
    if (PyList_Check(o) && (PyList_GET_SIZE(o) == k || PyList_GET_SIZE(o) == k + 1)) {
        *len = PyList_GET_SIZE(o);
        return &PyList_GET_ITEM(o, 0);
    }
    PyErr_Format(PyExc_TypeError, "%s must be a sequence of %zd or %zd", what, k, k + 1);
    return NULL;
}

/* Both time cores' arguments from `params` on, and their per-server scratch: costs, hot-spot
 * loads, a*k and estimated times to first token, requests and KV-full flags, on the stack for
 * the usual candidate counts. */
typedef struct {
    Py_buffer pb;
    const double *pv;
    long long B, cap, nt, pin, mbs;
    double uw, dw, bonus, hf, slack, lcap, div;
    double *cv, *hv, *av, *tt;
    long long *req;
    char *full;
    double small[4 * SMALL_N];
    long long req_small[SMALL_N];
    char full_small[SMALL_N];
} TimeArgs;

/* 0, or -1 with an exception set (and nothing to release). */
static int time_args(PyObject *const *args, Py_ssize_t n, TimeArgs *t) {
    if (PyObject_GetBuffer(args[T_PARAMS], &t->pb, PyBUF_FORMAT) < 0) {
        PyErr_SetString(PyExc_TypeError, "params must be a buffer of doubles (array('d'))");
        return -1;
    }
    if (t->pb.format == NULL || strcmp(t->pb.format, "d") != 0 ||
        t->pb.len != n * N_PARAMS * (Py_ssize_t)sizeof(double)) {
        PyErr_Format(PyExc_ValueError, "params must hold %d doubles per server (%zd servers), found "
                     "%zd bytes", N_PARAMS, n, t->pb.len);
        PyBuffer_Release(&t->pb);
        return -1;
    }
    t->pv = (const double *)t->pb.buf;
    if (as_ll(args[T_BS], &t->B, "block_size") || as_ll(args[T_CAP], &t->cap, "cap") ||
        as_ll(args[T_NT], &t->nt, "num_tokens") || as_ll(args[T_PIN], &t->pin, "pinned") ||
        as_ll(args[T_MBS], &t->mbs, "max_batch_size") ||
        as_d(args[T_UW], &t->uw, "uncached_weight") || as_d(args[T_DW], &t->dw, "decode_weight") ||
        as_d(args[T_BONUS], &t->bonus, "affinity_bonus") || as_d(args[T_HF], &t->hf, "hotspot_factor") ||
        as_d(args[T_SLACK], &t->slack, "hotspot_slack_s") || as_d(args[T_LCAP], &t->lcap, "load_cap") ||
        as_d(args[T_DIV], &t->div, "affinity_div")) {
        PyBuffer_Release(&t->pb);
        return -1;
    }
    if (!(t->div >= 1.0)) {     /* 1 + affinity_slack, the policy's argument checked >= 0 */
        PyErr_Format(PyExc_ValueError, "affinity_div must be >= 1, found %g", t->div);
        PyBuffer_Release(&t->pb);
        return -1;
    }
    if (n <= SMALL_N) {
        t->cv = t->small;
        t->req = t->req_small;
        t->full = t->full_small;
    } else {
        t->cv = PyMem_Malloc(4 * n * sizeof(double));
        t->req = PyMem_Malloc(n * sizeof(long long));
        t->full = PyMem_Malloc(n);
        if (t->cv == NULL || t->req == NULL || t->full == NULL) {
            PyMem_Free(t->cv);
            PyMem_Free(t->req);
            PyMem_Free(t->full);
            PyBuffer_Release(&t->pb);
            PyErr_NoMemory();
            return -1;
        }
    }
    t->hv = t->cv + n;
    t->av = t->cv + 2 * n;
    t->tt = t->cv + 3 * n;
    return 0;
}

static void time_args_release(TimeArgs *t) {
    PyBuffer_Release(&t->pb);
    if (t->cv != t->small) {
        PyMem_Free(t->cv);
        PyMem_Free(t->req);
        PyMem_Free(t->full);
    }
}

/* Server i's cost, hot-spot load and KV-full flag from its match `mt`, load (r, tok) and phase
 * (q queued, npf in prefill, tpf their tokens, held KV tokens): `_time_core`'s loop body,
 * operation for operation. The one place of the rule for both cores. */
static inline void time_row(TimeArgs *t, Py_ssize_t i, long long mt, long long r, long long tok,
                            long long q, long long npf, long long tpf, long long held) {
    const double *pp = t->pv + i * N_PARAMS;
    double a = pp[P_A], chunk = pp[P_CHUNK], s0 = pp[P_S0], s1 = pp[P_S1], s2 = pp[P_S2];
    double kvcap = pp[P_KVCAP], k = pp[P_K];
    long long nt = t->nt, p = nt - mt, d = r - npf;
    /* x = dw * (s0 + s1 * d + s2 * (tok - tpf)): a decode step there, were one to run now;
     * step = x if d > 0 else 0.0 */
    double x = s0 + s1 * (double)d;
    x = x + s2 * (double)(tok - tpf);
    x = t->dw * x;
    double step = d > 0 ? x : 0.0;
    /* k * ((q + uw * p) * a + max(1, (q + p) / chunk) * step): the first token takes one engine
     * step at least, however few tokens are left to compute */
    double c = (double)q + t->uw * (double)p;
    c = c * a;
    double w = (double)(q + p), steps = w / chunk;
    if (steps < 1.0)
        steps = 1.0;
    double ws = steps * step;
    c = c + ws;
    t->cv[i] = k * c;
    /* the estimated time to first token, k * (w * a + max(1, w / chunk) * step): the cost with
     * uncached_weight 1 and no bonus (router/policy_kv.py `_predicted_s`) */
    t->tt[i] = k * (w * a + ws);
    t->hv[i] = k * x;         /* its decode step (a TPOT estimate), decoding or not */
    t->av[i] = a * k;
    t->req[i] = r;
    /* its KV cannot hold this prompt's uncached tokens beside the distinct tokens its leases'
     * prompts hold (`held`: a shared prefix once, router/leases.py `_kv`): it would wait for
     * memory (the matched tokens are resident there already; counting the whole prompt, or a
     * shared prefix once per lease, passed a prefix tree's home over whenever its siblings
     * were in flight) */
    t->full[i] = kvcap > 0.0 && (double)(held + p) > kvcap;
}

/* The end of both time cores: the affinity bonus and slack, then `decide`; steals `matched`. */
static PyObject *time_decide(TimeArgs *t, Py_ssize_t n, PyObject *matched, Py_ssize_t nextra) {
    if (t->pin >= 0 && t->pin < n) {    /* bonus * num_tokens * a * k */
        double c = t->cv[t->pin] - t->bonus * (double)t->nt * t->av[t->pin];
        /* the affinity slack: a session's server with a credit keeps it while its cost is at
         * most `div` (1 + affinity_slack) times another's (router/policy_kv.py `_time_core`) */
        if (t->bonus > 0.0 && c > 0.0)
            c = c / t->div;
        t->cv[t->pin] = c;
    }
    return decide(n, matched, t->cv, t->hv, t->req, t->hf, t->slack, t->mbs, t->lcap, t->full,
                  nextra);
}

static PyObject *time_core(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_check("time_core", nargs, T_N_ARGS) < 0)
        return NULL;
    PyObject *servers = args[T_SERVERS], *mdict = args[T_MATCHED], *loads = args[T_LOADS];
    PyObject *phases = args[T_PHASES];
    Py_ssize_t n;
    if (check_lists(servers, mdict, loads, &n))
        return NULL;
    if (!PyList_Check(phases) || PyList_GET_SIZE(phases) != n) {
        PyErr_SetString(PyExc_ValueError, "phases must be a list of one item per server");
        return NULL;
    }
    TimeArgs t;
    if (time_args(args, n, &t))
        return NULL;
    PyObject *matched = NULL, *ans = NULL;
    if ((matched = PyList_New(n)) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long mt, r, tok, q, npf, tpf, held;
        PyObject *const *ph;
        Py_ssize_t len;
        if (match_of(mdict, PyList_GET_ITEM(servers, i), t.B, t.cap, &mt) ||
            as_pair(PyList_GET_ITEM(loads, i), &r, &tok, "a load") ||
            (ph = items_of_opt(PyList_GET_ITEM(phases, i), 3, &len, "a phase")) == NULL ||
            as_ll(ph[0], &q, "queued prefill tokens") || as_ll(ph[1], &npf, "leases in prefill") ||
            as_ll(ph[2], &tpf, "their tokens"))
            goto fail;
        held = tok;     /* a phase without held KV tokens: its leases' whole prompts */
        if (len == 4 && as_ll(ph[3], &held, "held KV tokens"))
            goto fail;
        PyObject *m = PyLong_FromLongLong(mt);
        if (m == NULL)
            goto fail;
        PyList_SET_ITEM(matched, i, m);
        time_row(&t, i, mt, r, tok, q, npf, tpf, held);
    }
    ans = time_decide(&t, n, matched, 0);
    matched = NULL;
fail:
    time_args_release(&t);
    Py_XDECREF(matched);
    return ans;
}

static PyObject *time_core_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_check("time_core_table", nargs, T_N_ARGS + 1) < 0)
        return NULL;
    long long cursor;
    if (as_ll(args[T_CURSOR], &cursor, "cursor"))
        return NULL;
    if (cursor < 0) {
        PyErr_Format(PyExc_ValueError, "cursor must be >= 0, found %lld", cursor);
        return NULL;
    }
    PyObject *servers = args[T_SERVERS], *mdict = args[T_MATCHED], *states = args[T_STATES];
    PyObject *positions = args[T_POSITIONS];
    if (!PyList_Check(servers) || !PyDict_Check(states) || !PyDict_Check(positions) ||
        (mdict != Py_None && !PyDict_Check(mdict))) {
        PyErr_SetString(PyExc_TypeError, "servers must be a list, states and positions dicts and "
                        "matched a dict or None");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(servers);
    if (n < 1 || PyDict_GET_SIZE(positions) != n) {
        PyErr_Format(PyExc_ValueError, "expected at least one server and one position per server, "
                     "found %zd servers and %zd positions", n, PyDict_GET_SIZE(positions));
        return NULL;
    }
    TimeArgs t;
    if (time_args(args, n, &t))
        return NULL;
    PyObject *matched = NULL, *loads = NULL, *ans = NULL;
    long long mt_small[SMALL_N], *mts = n <= SMALL_N ? mt_small : PyMem_Malloc(n * sizeof(long long));
    if (mts == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if ((matched = PyList_New(n)) == NULL || (loads = PyList_New(n)) == NULL)
        goto fail;
    /* matches: `match_of` for every server, as the matched servers' entries put in place */
    long long none = 0 < t.cap ? 0 : t.cap;    /* `mt if mt < cap else cap` of mt = 0 */
    for (Py_ssize_t i = 0; i < n; i++)
        mts[i] = none;
    if (mdict != Py_None) {
        Py_ssize_t it = 0;
        PyObject *server, *v;
        while (PyDict_Next(mdict, &it, &server, &v)) {
            PyObject *pos = PyDict_GetItemWithError(positions, server);
            long long i, mt;
            if (pos == NULL) {
                if (PyErr_Occurred())
                    goto fail;
                continue;       /* not a candidate */
            }
            if (as_ll(pos, &i, "a position") || as_ll(v, &mt, "a matched block count"))
                goto fail;
            if (i < 0 || i >= n) {
                PyErr_Format(PyExc_ValueError, "a position must be in [0, %zd), found %lld", n, i);
                goto fail;
            }
            mt *= t.B;
            mts[i] = mt < t.cap ? mt : t.cap;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long r = 0, tok = 0, q = 0, npf = 0, tpf = 0, held = 0;
        PyObject *server = PyList_GET_ITEM(servers, i);
        PyObject *st = PyDict_GetItemWithError(states, server), *ld = zero_load;
        if (st != NULL) {
            Py_ssize_t len;
            PyObject *const *f = items_of_opt(st, 4, &len, "a lease state");
            if (f == NULL || as_pair(ld = f[0], &r, &tok, "a load") ||
                as_ll(f[1], &q, "queued prefill tokens") || as_ll(f[2], &npf, "leases in prefill") ||
                as_ll(f[3], &tpf, "their tokens"))
                goto fail;
            held = tok;     /* a state without held KV tokens: its leases' whole prompts */
            if (len == 5 && as_ll(f[4], &held, "held KV tokens"))
                goto fail;
        } else if (PyErr_Occurred())
            goto fail;
        Py_INCREF(ld);
        PyList_SET_ITEM(loads, i, ld);
        PyObject *m = PyLong_FromLongLong(mts[i]);
        if (m == NULL)
            goto fail;
        PyList_SET_ITEM(matched, i, m);
        time_row(&t, i, mts[i], r, tok, q, npf, tpf, held);
    }
    ans = time_decide(&t, n, matched, 3);
    matched = NULL;
    if (ans != NULL) {
        /* the pick, `select`'s rule: the tied servers in turn (`cursor`), and its estimate */
        PyObject *tied = PyTuple_GET_ITEM(ans, 2);
        Py_ssize_t nt = PyList_GET_SIZE(tied);
        PyObject *pick = PyList_GET_ITEM(tied, nt > 1 ? (Py_ssize_t)(cursor % nt) : 0);
        PyObject *est = PyFloat_FromDouble(t.tt[PyLong_AsSsize_t(pick)]);
        PyTuple_SET_ITEM(ans, 6, loads);
        loads = NULL;
        if (est == NULL) {
            Py_CLEAR(ans);
            goto fail;
        }
        Py_INCREF(pick);
        PyTuple_SET_ITEM(ans, 7, pick);
        PyTuple_SET_ITEM(ans, 8, est);
    }
fail:
    time_args_release(&t);
    if (mts != mt_small)
        PyMem_Free(mts);
    Py_XDECREF(matched);
    Py_XDECREF(loads);
    return ans;
}

/* ---- the lease table's map (router/leases.py `LeaseTable`), written where time_core_table reads it */

/* A new int for `v`, stolen into tuple `t` at `i`; -1 on failure. */
static inline int set_ll(PyObject *t, Py_ssize_t i, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL)
        return -1;
    PyTuple_SET_ITEM(t, i, o);
    return 0;
}

/* states[server] = ((r, t), q, n, pt, held) and kv[server] = (priv, deep); -1 on failure (the
 * maps unchanged unless a dict store itself failed). */
static int lease_write(PyObject *states, PyObject *kv, PyObject *server, long long r, long long t,
                       long long q, long long n, long long pt, long long priv, long long deep) {
    PyObject *ld = PyTuple_New(2), *st = PyTuple_New(5), *k = PyTuple_New(2);
    int rc = -1;
    if (ld == NULL || st == NULL || k == NULL || set_ll(ld, 0, r) || set_ll(ld, 1, t) ||
        set_ll(st, 1, q) || set_ll(st, 2, n) || set_ll(st, 3, pt) || set_ll(st, 4, priv + deep) ||
        set_ll(k, 0, priv) || set_ll(k, 1, deep))
        goto done;
    PyTuple_SET_ITEM(st, 0, ld);
    ld = NULL;
    if (PyDict_SetItem(kv, server, k) == 0 && PyDict_SetItem(states, server, st) == 0)
        rc = 0;
done:
    Py_XDECREF(ld);
    Py_XDECREF(st);
    Py_XDECREF(k);
    return rc;
}

/* A server's state and kv entries read as numbers: 0, or -1 with TypeError (a shape the
 * recipe's unpacking would not take) or OverflowError (beyond a long long). */
static int lease_read(PyObject *st, PyObject *kv_entry, long long *r, long long *t, long long *q,
                      long long *n, long long *pt, long long *priv, long long *deep) {
    if (!PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 5 || !PyTuple_CheckExact(kv_entry) ||
        PyTuple_GET_SIZE(kv_entry) != 2) {
        PyErr_SetString(PyExc_TypeError, "a lease state must be a 5-tuple and its kv entry a pair");
        return -1;
    }
    return (as_pair(PyTuple_GET_ITEM(st, 0), r, t, "a load") ||
            as_ll(PyTuple_GET_ITEM(st, 1), q, "queued prefill tokens") ||
            as_ll(PyTuple_GET_ITEM(st, 2), n, "leases in prefill") ||
            as_ll(PyTuple_GET_ITEM(st, 3), pt, "their tokens") ||
            as_ll(PyTuple_GET_ITEM(kv_entry, 0), priv, "private tokens") ||
            as_ll(PyTuple_GET_ITEM(kv_entry, 1), deep, "the deepest shared prefix")) ? -1 : 0;
}

static PyObject *overflow(void) {
    PyErr_SetString(PyExc_OverflowError, "lease numbers beyond a long long");
    return NULL;
}

/* The lease table's two maps must be plain dicts (their borrowed lookups below rely on it). */
static int lease_maps_check(const char *fn, PyObject *states, PyObject *kv) {
    if (PyDict_CheckExact(states) && PyDict_CheckExact(kv))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: states and kv must be dicts", fn);
    return -1;
}

/* `server`'s entry in `map` (borrowed), or NULL with KeyError: a server with a lease state has
   an entry in both maps. */
static PyObject *lease_entry(PyObject *map, PyObject *server) {
    PyObject *e = PyDict_GetItemWithError(map, server);
    if (e == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, server);
    return e;
}

PyDoc_STRVAR(lease_add_doc,
"lease_add(states, kv, server, tokens, prefill) -> None\n\n"
"router/leases.py `_add` (the recipe, its docstring has the rule): a lease of `tokens` prompt\n"
"tokens, `prefill` of them uncached, joins `server`'s entries in the lease table's maps.\n"
"OverflowError or TypeError, nothing changed, where a number is beyond a long long or an entry\n"
"is not the recipe's shape: the caller runs the recipe then.");

static PyObject *lease_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_check("lease_add", nargs, 5) < 0)
        return NULL;
    PyObject *states = args[0], *kv = args[1], *server = args[2];
    long long tokens, prefill, r = 0, t = 0, q = 0, n = 0, pt = 0, priv = 0, deep = 0, shared;
    if (lease_maps_check("lease_add", states, kv) < 0)
        return NULL;
    if (as_ll(args[3], &tokens, "tokens") || as_ll(args[4], &prefill, "prefill"))
        return NULL;
    if (__builtin_sub_overflow(tokens, prefill, &shared))
        return overflow();
    PyObject *st = PyDict_GetItemWithError(states, server);
    if (st == NULL) {
        if (PyErr_Occurred())
            return NULL;
        /* its first lease: (prefill, shared) */
        if (lease_write(states, kv, server, 1, tokens, prefill, 1, tokens, prefill, shared) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *k = lease_entry(kv, server);
    if (k == NULL)
        return NULL;
    if (lease_read(st, k, &r, &t, &q, &n, &pt, &priv, &deep) < 0)
        return NULL;
    long long held;
    if (shared > deep)
        deep = shared;
    if (__builtin_add_overflow(r, 1, &r) || __builtin_add_overflow(t, tokens, &t) ||
        __builtin_add_overflow(q, prefill, &q) || __builtin_add_overflow(n, 1, &n) ||
        __builtin_add_overflow(pt, tokens, &pt) || __builtin_add_overflow(priv, prefill, &priv) ||
        __builtin_add_overflow(priv, deep, &held))
        return overflow();
    if (lease_write(states, kv, server, r, t, q, n, pt, priv, deep) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(lease_remove_doc,
"lease_remove(states, kv, server, tokens, prefill, private, in_prefill) -> None\n\n"
"router/leases.py `_remove` (the recipe, its docstring has the rule): a lease leaves `server`'s\n"
"entries in the lease table's maps. OverflowError or TypeError, nothing changed, as `lease_add`.");

static PyObject *lease_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs_check("lease_remove", nargs, 7) < 0)
        return NULL;
    PyObject *states = args[0], *kv = args[1], *server = args[2];
    long long tokens, prefill, private_, r, t, q, n, pt, priv, deep, held;
    if (lease_maps_check("lease_remove", states, kv) < 0)
        return NULL;
    int in_prefill = PyObject_IsTrue(args[6]);
    if (in_prefill < 0 || as_ll(args[3], &tokens, "tokens") || as_ll(args[4], &prefill, "prefill") ||
        as_ll(args[5], &private_, "private"))
        return NULL;
    PyObject *st = lease_entry(states, server);
    if (st == NULL)
        return NULL;
    if (!PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 5) {
        PyErr_SetString(PyExc_TypeError, "a lease state must be a 5-tuple");
        return NULL;
    }
    if (as_pair(PyTuple_GET_ITEM(st, 0), &r, &t, "a load"))
        return NULL;
    if (r == 1) {       /* its server's last lease: the phase sums go with it */
        if (PyDict_DelItem(states, server) < 0 || PyDict_DelItem(kv, server) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *k = lease_entry(kv, server);
    if (k == NULL)
        return NULL;
    if (lease_read(st, k, &r, &t, &q, &n, &pt, &priv, &deep) < 0)
        return NULL;
    if (__builtin_sub_overflow(r, 1, &r) || __builtin_sub_overflow(t, tokens, &t) ||
        __builtin_sub_overflow(priv, private_, &priv) || __builtin_add_overflow(priv, deep, &held))
        return overflow();
    if (in_prefill && (__builtin_sub_overflow(q, prefill, &q) || __builtin_sub_overflow(n, 1, &n) ||
                       __builtin_sub_overflow(pt, tokens, &pt)))
        return overflow();
    if (lease_write(states, kv, server, r, t, q, n, pt, priv, deep) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"core", (PyCFunction)(void (*)(void))core, METH_FASTCALL, core_doc},
    {"time_core", (PyCFunction)(void (*)(void))time_core, METH_FASTCALL, time_core_doc},
    {"time_core_table", (PyCFunction)(void (*)(void))time_core_table, METH_FASTCALL,
     time_core_table_doc},
    {"lease_add", (PyCFunction)(void (*)(void))lease_add, METH_FASTCALL, lease_add_doc},
    {"lease_remove", (PyCFunction)(void (*)(void))lease_remove, METH_FASTCALL, lease_remove_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._kv_cost",
    "Native numeric cores of kv_cache_aware placement (router/policy_kv.py `_time_core`, `_core`); see router/_kv_cost.c.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kv_cost(void) {
    if (zero_load == NULL && (zero_load = Py_BuildValue("(ii)", 0, 0)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
