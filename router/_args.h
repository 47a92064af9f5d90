/* What the router's native modules (router/_chain.c, router/_kv_cost.c, router/_owner_map.c)
 * share: the argument-count check of their METH_FASTCALL functions, one wording for all.
 *
 * A header, not a .c file: setup.py builds each module from its one source, and
 * bench/routing/judged.sh compiles each router/_*.c alone with gcc; the quoted include finds this
 * file beside the source in both. setup.py's `depends` rebuilds the modules when it changes.
 * Include it after <Python.h>.
 */
#ifndef SPLITSERVE_ROUTER_ARGS_H
#define SPLITSERVE_ROUTER_ARGS_H

/* 0 when `nargs` is `want`; else -1 with a TypeError naming `fn`, the count expected and found. */
static inline int nargs_check(const char *fn, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, found %zd", fn, want, nargs);
    return -1;
}

#endif
