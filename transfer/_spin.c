/* transfer/_spin.c: a bounded busy-poll of file descriptors with the GIL released.

   wait(fds, seconds) -> int: poll(2) the descriptors (POLLIN) without sleeping, again and again,
   until one is readable (returns how many are) or `seconds` passed (returns 0). The GIL is
   released for the whole wait, so the process's other threads (the engine's) run meanwhile; a
   loop in Python around select(timeout=0) would run bytecode between the calls, holding the GIL
   most of the time and retaking it a few million times a second.

   Why spin at all (transfer/zmq_io.py, IoLoop): a thread asleep in poll(2) is woken by the
   kernel when data lands, but the wake-up and the code it then runs are slow on a core that
   went idle (deep C-states, cold caches): ~85-90 µs per control hop on an H100 host against
   9-30 µs for the socket itself (bench/transfer/control.py, 2026-12-07). A listener that
   expects a message within a few hundred µs spins here instead, bounded by its caller.

   Errors of poll(2) other than EINTR end the wait as "readable" (1): the caller's own poll
   then sees and reports the descriptor's state. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *spin_wait(PyObject *self, PyObject *args) {
    PyObject *seq;
    double seconds;
    if (!PyArg_ParseTuple(args, "Od", &seq, &seconds))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "fds must be a sequence of file descriptors");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    struct pollfd small[16];
    struct pollfd *pfds = n <= 16 ? small : malloc(sizeof(struct pollfd) * (size_t)n);
    if (pfds == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (fd == -1 && PyErr_Occurred()) {
            if (pfds != small)
                free(pfds);
            Py_DECREF(fast);
            return NULL;
        }
        pfds[i].fd = (int)fd;
        pfds[i].events = POLLIN;
        pfds[i].revents = 0;
    }
    Py_DECREF(fast);
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS
    double deadline = now_s() + seconds;
    for (;;) {
        int r = poll(pfds, (nfds_t)n, 0);
        if (r > 0 || (r < 0 && errno != EINTR)) {
            ready = r > 0 ? r : 1;
            break;
        }
        if (now_s() >= deadline)
            break;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
    Py_END_ALLOW_THREADS
    if (pfds != small)
        free(pfds);
    return PyLong_FromLong(ready);
}

static PyMethodDef methods[] = {
    {"wait", spin_wait, METH_VARARGS,
     "wait(fds, seconds) -> int: busy-poll fds for POLLIN (GIL released) until one is readable "
     "(how many) or seconds passed (0)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_spin", NULL, -1, methods};

PyMODINIT_FUNC PyInit__spin(void) { return PyModule_Create(&module); }
