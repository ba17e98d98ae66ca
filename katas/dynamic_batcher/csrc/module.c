/* CPython binding of the dynamic batcher's C hot path (hotpath.h), built as ``_hotpath``.
 *
 * Columns cross the boundary as buffers of int32 (array('i'), a numpy int32 array, or
 * memoryview(raw_bytes).cast('i')) with no copy; outputs are written into caller-owned
 * writable buffers. Arguments are checked here, each error naming its parameter; the GIL
 * is released around the C call, which checks the entries themselves (O(n), off the GIL).
 * The same file binds the stub and the reference: when the C returns HP_NOT_IMPLEMENTED
 * it raises the stub sentinel, katas._runtime.todo.Todo.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "hotpath.h"

/* Where a learner reads the contract of the function they have not written yet. */
#define CONTRACT "katas/dynamic_batcher/csrc/hotpath.h"

static int native_little_endian(void) {
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* True for a struct-module format that describes one native-order 4-byte signed int. */
static int is_int32_format(const char *format, Py_ssize_t itemsize) {
    if (format == NULL || itemsize != 4) {
        return 0; /* a NULL format means unsigned bytes ('B') */
    }
    if (*format == '@' || *format == '=') {
        format++;
    } else if (*format == '<') {
        if (!native_little_endian()) {
            return 0;
        }
        format++;
    } else if (*format == '>' || *format == '!') {
        if (native_little_endian()) {
            return 0;
        }
        format++;
    }
    /* 'l' qualifies only where it is 4 bytes wide, which the itemsize check ensured. */
    return strcmp(format, "i") == 0 || strcmp(format, "l") == 0;
}

/* Get a one-dimensional, C-contiguous int32 buffer of ``obj``; its length in ``*length``.
 * On failure set an exception naming ``name`` and return -1 (nothing to release). */
static int get_column(PyObject *obj, const char *name, int writable, Py_buffer *view,
                      hp_int *length) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a buffer of int32 items (e.g. array('i')), got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous buffer of int32 items",
                         name);
        }
        return -1;
    }
    if (view->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be one-dimensional, got %d dimensions", name,
                     view->ndim);
    } else if (!is_int32_format(view->format, view->itemsize)) {
        PyErr_Format(PyExc_ValueError,
                     "%s must hold native int32 items (array('i'); for raw bytes use "
                     "memoryview(data).cast('i')), got format '%s' with item size %zd",
                     name, view->format == NULL ? "B" : view->format, view->itemsize);
    } else if (writable && view->readonly) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a writable buffer (e.g. array('i')), got a read-only one",
                     name);
    } else if (view->len / view->itemsize > HP_INT_MAX) {
        PyErr_Format(PyExc_ValueError, "%s must have at most %d items, got %zd", name,
                     HP_INT_MAX, view->len / view->itemsize);
    } else {
        *length = (hp_int)(view->len / view->itemsize);
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

/* Convert a non-negative count that must fit an hp_int; ``bool`` is not a count. */
static int get_count(PyObject *obj, const char *name, hp_int *out) {
    if (PyBool_Check(obj) || !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow != 0 || value < 0 || value > HP_INT_MAX) {
        PyErr_Format(PyExc_ValueError, "%s must be an int in [0, %d], got %R", name, HP_INT_MAX,
                     obj);
        return -1;
    }
    *out = (hp_int)value;
    return 0;
}

static int buffers_overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *a0 = (const char *)a->buf;
    const char *b0 = (const char *)b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + b->len && b0 < a0 + a->len;
}

/* Raise the stub sentinel katas._runtime.todo.Todo, as a Python stub does: the harness
 * reports it as one "not implemented yet" line. */
static void raise_todo(const char *function) {
    PyObject *todo_module = PyImport_ImportModule("katas._runtime.todo");
    if (todo_module == NULL) {
        return;
    }
    PyObject *todo = PyObject_GetAttrString(todo_module, "Todo");
    Py_DECREF(todo_module);
    if (todo == NULL) {
        return;
    }
    PyObject *exc = PyObject_CallFunction(todo, "ss", function, "see " CONTRACT);
    if (exc != NULL) {
        PyErr_SetObject(todo, exc);
        Py_DECREF(exc);
    }
    Py_DECREF(todo);
}

/* Turn a return code other than HP_OK into a Python exception. */
static void raise_for(int rc, const char *function) {
    if (rc == HP_NOT_IMPLEMENTED) {
        raise_todo(function);
    } else if (rc == HP_INVALID) {
        PyErr_Format(PyExc_ValueError, "%s rejected its arguments (HP_INVALID)", function);
    } else {
        PyErr_Format(PyExc_RuntimeError, "%s returned the unknown code %d", function, rc);
    }
}

PyDoc_STRVAR(fill_token_budget_doc,
             "fill_token_budget($module, /, need, chunk, *, token_budget, max_seqs)\n"
             "--\n"
             "\n"
             "Apply one step's token budget to requests in scheduling order.\n"
             "\n"
             "need[i] >= 1 is the tokens request i still has to compute. Each request gets\n"
             "chunk[i] = min(need[i], budget left), in order, until the budget is spent or\n"
             "max_seqs requests are scheduled; chunk[i] = 0 for the rest. need and chunk are\n"
             "int32 buffers of the same length (chunk writable, not overlapping need).\n"
             "Returns (requests scheduled, tokens scheduled).");

static PyObject *fill_token_budget(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"need", "chunk", "token_budget", "max_seqs", NULL};
    PyObject *need_obj, *chunk_obj, *budget_obj, *max_seqs_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO$OO:fill_token_budget", kwlist, &need_obj,
                                     &chunk_obj, &budget_obj, &max_seqs_obj)) {
        return NULL;
    }
    hp_int token_budget, max_seqs;
    if (get_count(budget_obj, "token_budget", &token_budget) < 0 ||
        get_count(max_seqs_obj, "max_seqs", &max_seqs) < 0) {
        return NULL;
    }

    Py_buffer need, chunk;
    hp_int n, chunk_len;
    if (get_column(need_obj, "need", 0, &need, &n) < 0) {
        return NULL;
    }
    if (get_column(chunk_obj, "chunk", 1, &chunk, &chunk_len) < 0) {
        PyBuffer_Release(&need);
        return NULL;
    }
    PyObject *result = NULL;
    const hp_int *need_items = (const hp_int *)need.buf;
    if (chunk_len != n) {
        PyErr_Format(PyExc_ValueError, "chunk must have as many items as need (%d), got %d",
                     (int)n, (int)chunk_len);
        goto done;
    }
    if (buffers_overlap(&need, &chunk)) {
        PyErr_SetString(PyExc_ValueError, "chunk must not share memory with need");
        goto done;
    }
    hp_int seqs = 0, tokens = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hp_fill_token_budget(n, need_items, token_budget, max_seqs, (hp_int *)chunk.buf, &seqs,
                              &tokens);
    Py_END_ALLOW_THREADS
    if (rc == HP_INVALID) {
        /* The scalars and buffers were checked above, so name the entry at fault. */
        for (hp_int i = 0; i < n; i++) {
            if (need_items[i] < 1) {
                PyErr_Format(PyExc_ValueError,
                             "need[%d] must be >= 1 (the tokens request %d still has to "
                             "compute), got %d",
                             (int)i, (int)i, (int)need_items[i]);
                goto done;
            }
        }
    }
    if (rc != HP_OK) {
        raise_for(rc, "hp_fill_token_budget");
        goto done;
    }
    result = Py_BuildValue("(ii)", (int)seqs, (int)tokens);
done:
    PyBuffer_Release(&chunk);
    PyBuffer_Release(&need);
    return result;
}


/* The columns an hp_state call takes, acquired and checked together: known, computed,
 * held, table, free_ids (the state, all writable), then the call's own (chunk, finished). */
#define STATE_COLUMNS 5
#define MAX_COLUMNS 7

typedef struct {
    int count;              /* columns acquired so far, released by release_columns() */
    Py_buffer views[MAX_COLUMNS];
    hp_int lengths[MAX_COLUMNS];
} columns;

static void release_columns(columns *c) {
    while (c->count > 0) {
        PyBuffer_Release(&c->views[--c->count]);
    }
}

/* Convert the state's counts (n, free_top, stride, block_size), acquire ``total`` columns
 * and check them against those counts: known, computed, held and the call's columns have
 * one length (the rows), table rows * stride; n and free_top fit their columns; no two
 * columns share memory. Fills ``state`` on success. */
static int get_state(PyObject *const *objs, const char *const *names, const int *writable,
                     int total, PyObject *const counts[4], columns *c, hp_state *state) {
    hp_int n, free_top, stride, block_size;
    if (get_count(counts[0], "n", &n) < 0 || get_count(counts[1], "free_top", &free_top) < 0 ||
        get_count(counts[2], "stride", &stride) < 0 ||
        get_count(counts[3], "block_size", &block_size) < 0) {
        return -1;
    }
    for (c->count = 0; c->count < total; c->count++) {
        if (get_column(objs[c->count], names[c->count], writable[c->count],
                       &c->views[c->count], &c->lengths[c->count]) < 0) {
            return -1;
        }
    }
    hp_int rows = c->lengths[0];
    for (int k = 1; k < total; k++) {
        if (k != 3 && k != 4 && c->lengths[k] != rows) {
            PyErr_Format(PyExc_ValueError, "%s must have as many items as known (%d), got %d",
                         names[k], (int)rows, (int)c->lengths[k]);
            return -1;
        }
    }
    if (stride < 1 || block_size < 1) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 1, got %d",
                     stride < 1 ? "stride" : "block_size", (int)(stride < 1 ? stride : block_size));
        return -1;
    }
    if ((int64_t)c->lengths[3] != (int64_t)rows * stride) {
        PyErr_Format(PyExc_ValueError,
                     "table must have rows * stride = %lld items (%d rows of %d), got %d",
                     (long long)rows * stride, (int)rows, (int)stride, (int)c->lengths[3]);
        return -1;
    }
    if (n > rows) {
        PyErr_Format(PyExc_ValueError, "n must be <= %d (the length of known), got %d",
                     (int)rows, (int)n);
        return -1;
    }
    if (free_top > c->lengths[4]) {
        PyErr_Format(PyExc_ValueError, "free_top must be <= %d (the length of free_ids), got %d",
                     (int)c->lengths[4], (int)free_top);
        return -1;
    }
    for (int a = 0; a < total; a++) {
        for (int b = a + 1; b < total; b++) {
            if (buffers_overlap(&c->views[a], &c->views[b])) {
                PyErr_Format(PyExc_ValueError, "%s must not share memory with %s", names[b],
                             names[a]);
                return -1;
            }
        }
    }
    hp_state parsed = {rows, n, stride, block_size, c->lengths[4], free_top,
                       (hp_int *)c->views[0].buf, (hp_int *)c->views[1].buf,
                       (hp_int *)c->views[2].buf, (hp_int *)c->views[3].buf,
                       (hp_int *)c->views[4].buf};
    *state = parsed;
    return 0;
}

#define LAYOUT                                                                              \
    "computed < known, held == ceil(computed / block_size), ceil(known / block_size) <= "   \
    "stride, held + free_top <= len(free_ids)"

PyDoc_STRVAR(schedule_doc,
             "schedule($module, /, known, computed, held, table, free_ids, chunk, *, n,\n"
             "         free_top, stride, block_size, token_budget, max_seqs)\n"
             "--\n"
             "\n"
             "hp_schedule (csrc/hotpath.h): schedule the n running rows for one step, their\n"
             "blocks included, preempting from the last row when the free stack runs dry.\n"
             "Every buffer is a writable int32 column; known, computed, held and chunk have\n"
             "one length (the rows), table rows * stride, free_ids the pool's blocks; no two\n"
             "share memory. Returns (rows scheduled, tokens, rows preempted, n, free_top).");

static PyObject *schedule(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"known", "computed", "held", "table", "free_ids", "chunk",
                             "n", "free_top", "stride", "block_size", "token_budget",
                             "max_seqs", NULL};
    static const char *names[] = {"known", "computed", "held", "table", "free_ids", "chunk"};
    static const int writable[] = {1, 1, 1, 1, 1, 1};
    PyObject *objs[6];
    PyObject *n_obj, *free_top_obj, *stride_obj, *block_size_obj, *budget_obj, *max_seqs_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO$OOOOOO:schedule", kwlist, &objs[0],
                                     &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &n_obj,
                                     &free_top_obj, &stride_obj, &block_size_obj, &budget_obj,
                                     &max_seqs_obj)) {
        return NULL;
    }
    hp_int token_budget, max_seqs;
    if (get_count(budget_obj, "token_budget", &token_budget) < 0 ||
        get_count(max_seqs_obj, "max_seqs", &max_seqs) < 0) {
        return NULL;
    }
    PyObject *const counts[4] = {n_obj, free_top_obj, stride_obj, block_size_obj};
    columns c = {0};
    hp_state state;
    PyObject *result = NULL;
    if (get_state(objs, names, writable, 6, counts, &c, &state) < 0) {
        goto done;
    }
    hp_int *chunk = (hp_int *)c.views[5].buf;
    hp_int seqs = 0, tokens = 0, preempted = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hp_schedule(&state, token_budget, max_seqs, chunk, &seqs, &tokens, &preempted);
    Py_END_ALLOW_THREADS
    if (rc == HP_INVALID) {
        PyErr_SetString(PyExc_ValueError,
                        "hp_schedule rejected the state: some running row breaks the layout "
                        "of csrc/hotpath.h (" LAYOUT "); nothing was written");
    } else if (rc != HP_OK) {
        raise_for(rc, "hp_schedule");
    } else {
        result = Py_BuildValue("(iiiii)", (int)seqs, (int)tokens, (int)preempted, (int)state.n,
                               (int)state.free_top);
    }
done:
    release_columns(&c);
    return result;
}

PyDoc_STRVAR(apply_doc,
             "apply($module, /, known, computed, held, table, free_ids, chunk, finished, *,\n"
             "      n, free_top, stride, block_size, seqs)\n"
             "--\n"
             "\n"
             "hp_apply (csrc/hotpath.h): the step's outcome. Rows 0 .. seqs compute their\n"
             "chunk (a row reaching known samples a token: known += 1); rows flagged 1 in\n"
             "finished are released and the others moved down in order. The state columns\n"
             "are writable int32 columns as for schedule; chunk and finished are int32\n"
             "columns of the rows' length. Returns (n, free_top).");

static PyObject *apply(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"known", "computed", "held", "table", "free_ids", "chunk",
                             "finished", "n", "free_top", "stride", "block_size", "seqs",
                             NULL};
    static const char *names[] = {"known", "computed", "held", "table",
                                  "free_ids", "chunk", "finished"};
    static const int writable[] = {1, 1, 1, 1, 1, 0, 0};
    PyObject *objs[7];
    PyObject *n_obj, *free_top_obj, *stride_obj, *block_size_obj, *seqs_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOO$OOOOO:apply", kwlist, &objs[0],
                                     &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6],
                                     &n_obj, &free_top_obj, &stride_obj, &block_size_obj,
                                     &seqs_obj)) {
        return NULL;
    }
    hp_int seqs;
    if (get_count(seqs_obj, "seqs", &seqs) < 0) {
        return NULL;
    }
    PyObject *const counts[4] = {n_obj, free_top_obj, stride_obj, block_size_obj};
    columns c = {0};
    hp_state state;
    PyObject *result = NULL;
    if (get_state(objs, names, writable, 7, counts, &c, &state) < 0) {
        goto done;
    }
    if (seqs > state.n) {
        PyErr_Format(PyExc_ValueError, "seqs must be <= n (%d), got %d", (int)state.n,
                     (int)seqs);
        goto done;
    }
    const hp_int *chunk = (const hp_int *)c.views[5].buf;
    const hp_int *finished = (const hp_int *)c.views[6].buf;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hp_apply(&state, seqs, chunk, finished);
    Py_END_ALLOW_THREADS
    if (rc == HP_INVALID) {
        PyErr_SetString(PyExc_ValueError,
                        "hp_apply rejected the step: a flag in finished other than 0 or 1, a "
                        "scheduled chunk outside [1, known - computed] or not covered by held, "
                        "a row that would outgrow its table row, or a row breaking the layout "
                        "of csrc/hotpath.h (" LAYOUT "); nothing was written");
    } else if (rc != HP_OK) {
        raise_for(rc, "hp_apply");
    } else {
        result = Py_BuildValue("(ii)", (int)state.n, (int)state.free_top);
    }
done:
    release_columns(&c);
    return result;
}

static PyMethodDef hotpath_methods[] = {
    {"fill_token_budget", (PyCFunction)(void (*)(void))fill_token_budget,
     METH_VARARGS | METH_KEYWORDS, fill_token_budget_doc},
    {"schedule", (PyCFunction)(void (*)(void))schedule, METH_VARARGS | METH_KEYWORDS,
     schedule_doc},
    {"apply", (PyCFunction)(void (*)(void))apply, METH_VARARGS | METH_KEYWORDS, apply_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    "_hotpath",
    "The dynamic batcher's C hot path over int32 columns (see csrc/hotpath.h).",
    -1,
    hotpath_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__hotpath(void) {
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL) {
        return NULL;
    }
    /* The array typecode of a column, and the largest value an entry can hold. */
    if (PyModule_AddStringConstant(module, "TYPECODE", "i") < 0 ||
        PyModule_AddIntConstant(module, "INT_MAX", HP_INT_MAX) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
