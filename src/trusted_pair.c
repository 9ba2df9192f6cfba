/* needle.memory._trusted_pair: the CUDA backend's per-buffer allocate/release pair in C.

Every eager cuda() buffer is one call of the owner factory installed by
needle/memory/cuda_allocator.py and one release when the owner is dropped. In Python the pair
(CachingAllocator._allocate_trusted / _release_trusted plus the owner's __init__/__del__)
costs ~17,000 instructions per buffer, about a sixth of an eager ResNet9 step's host time.
This module does the same work on the same Python objects, so the allocator keeps a single
source of truth and every other path (the first allocation of a size, coalescing, segments,
limits, statistics readers, timeline recorders, re-entry from a destructor) stays in Python:

  * TrustedPair(allocator)(nbytes) -> TrustedOwner: pops the last block parked under the
    rounded size and updates the allocator's counters exactly as _allocate_trusted does;
    otherwise it calls allocator._allocate_trusted(nbytes).
  * dropping a TrustedOwner parks its block and updates the counters as _release_trusted
    does; otherwise (a recorder listening, a re-entrant release) it calls
    allocator._release_trusted(block).

  * FastRLock: the allocator's re-entrant lock. Its state lives in C fields that change only
    with the GIL held, so the pair can see at a glance whether any thread is inside one of
    the allocator's Python paths (which may hold the lock across a GIL switch in the middle
    of an update). When none is, the fast paths run without taking it: they hold the GIL
    throughout and run no Python code, so nothing can observe a half-updated allocator. When
    one is, the pair takes the Python path, which waits for the lock.

Taking an uncontended FastRLock touches no OS lock: the OS lock is taken only when a second
thread has to wait (on the owner's behalf, then by the waiter). A threading.RLock would do,
but each of its acquire calls parses keyword arguments (~850 instructions).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "structmember.h"

/* Block fields, read and written at their slot offsets (Block has __slots__). */
enum { F_FREE, F_SIZE, F_REQUESTED, F_CATEGORY, F_SEGMENT, F_OFFSET, N_FIELDS };
static const char *const FIELD_NAMES[N_FIELDS] = {"free", "size", "requested", "category",
                                                   "segment", "offset"};

/* Names read from the allocator's __dict__ and the category rows, interned once. */
enum {
  K_PARKED, K_DEPTH, K_PENDING, K_RECORDERS, K_USER_TOP, K_FRAMEWORK_TOP, K_OP_CATEGORY,
  K_DICT, K_BASE, N_KEYS
};
static const char *const KEY_NAMES[N_KEYS] = {
    "_parked", "_depth", "_pending", "_RECORDERS", "user_top", "framework_top", "op_category",
    "__dict__", "base"};

/* The counters the fast paths update: the allocator's `_all` (every live block), the values
   of its `_by_category` dict, and its `_parking` are these objects
   (needle/memory/_pair_state.py has the same in Python, for a tree built without this
   module). Plain C fields: an update is an add. */
typedef struct {
  PyObject_HEAD
  long long current, peak, current_requested, peak_requested;
} CategoryRow;

typedef struct {
  PyObject_HEAD
  long long parked_reuses;  /* allocations served by a parked block */
  long long parks;          /* releases that parked their block */
} ParkCounts;

static PyTypeObject ParkCountsType, CategoryRowType;

/* _pair_state.add_bytes / take_bytes */
static inline void add_bytes(CategoryRow *row, long long size, long long requested) {
  row->current += size;
  if (row->current > row->peak) row->peak = row->current;
  row->current_requested += requested;
  if (row->current_requested > row->peak_requested) row->peak_requested = row->current_requested;
}

static inline void take_bytes(CategoryRow *row, long long size, long long requested) {
  row->current -= size;
  row->current_requested -= requested;
}

/* ---- FastRLock ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  PyThread_type_lock lock;  /* held while the owner owns it and someone waits (or waited) */
  unsigned long owner;      /* valid while count > 0 */
  long count;               /* re-entrant depth; 0: free */
  long pending;             /* threads waiting on `lock` */
  int is_locked;            /* `lock` is held */
} FastRLock;

static PyTypeObject FastRLockType;

/* Takes the lock for `tid` waiting at most `timeout_us` (-1: forever); 1 taken, 0 not. */
static int rlock_acquire_contended(FastRLock *self, unsigned long tid, int blocking,
                                   PY_TIMEOUT_T timeout_us) {
  if (!self->is_locked && !self->pending) {
    /* the owner took it without the OS lock: take the OS lock on its behalf, so that its
       release is what lets a waiter in */
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) return 0;  /* cannot happen */
    self->is_locked = 1;
  }
  if (!blocking) return 0;
  self->pending += 1;
  PyLockStatus got;
  Py_BEGIN_ALLOW_THREADS
  got = PyThread_acquire_lock_timed(self->lock, timeout_us, 0);
  Py_END_ALLOW_THREADS
  self->pending -= 1;
  if (got != PY_LOCK_ACQUIRED) return 0;
  self->is_locked = 1;
  self->owner = tid;
  self->count = 1;
  return 1;
}

static int rlock_take(FastRLock *self, int blocking, PY_TIMEOUT_T timeout_us) {
  unsigned long tid = PyThread_get_thread_ident();
  if (self->count) {
    if (self->owner == tid) {
      self->count += 1;
      return 1;
    }
  } else if (!self->pending) {
    self->owner = tid;
    self->count = 1;
    return 1;
  }
  return rlock_acquire_contended(self, tid, blocking, timeout_us);
}

static PyObject *rlock_acquire(FastRLock *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
  int blocking = 1;
  double timeout = -1;
  if (nargs == 0 && kwnames == NULL) return PyBool_FromLong(rlock_take(self, 1, -1));
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs + nkw > 2) {
    PyErr_Format(PyExc_TypeError, "FastRLock.acquire: expected at most 2 arguments, got %zd",
                 nargs + nkw);
    return NULL;
  }
  PyObject *given[2] = {nargs > 0 ? args[0] : NULL, nargs > 1 ? args[1] : NULL};
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject *name = PyTuple_GET_ITEM(kwnames, k);
    int slot = PyUnicode_CompareWithASCIIString(name, "blocking") == 0 ? 0
               : PyUnicode_CompareWithASCIIString(name, "timeout") == 0 ? 1 : -1;
    if (slot < 0 || given[slot] != NULL) {
      PyErr_Format(PyExc_TypeError, "FastRLock.acquire: unexpected or repeated argument %R",
                   name);
      return NULL;
    }
    given[slot] = args[nargs + k];
  }
  if (given[0] != NULL && (blocking = PyObject_IsTrue(given[0])) < 0) return NULL;
  if (given[1] != NULL && (timeout = PyFloat_AsDouble(given[1])) == -1 && PyErr_Occurred())
    return NULL;
  if (!blocking && timeout != -1) {
    PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
    return NULL;
  }
  if (timeout < 0 && timeout != -1) {
    PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
    return NULL;
  }
  PY_TIMEOUT_T timeout_us = -1;
  if (timeout >= 0) {
    double us = timeout * 1e6;
    timeout_us = us >= (double)PY_TIMEOUT_MAX ? PY_TIMEOUT_MAX : (PY_TIMEOUT_T)us;
  }
  return PyBool_FromLong(rlock_take(self, blocking, timeout_us));
}

static int rlock_give(FastRLock *self) {
  if (self->count == 0 || self->owner != PyThread_get_thread_ident()) {
    PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
    return -1;
  }
  if (--self->count == 0 && self->is_locked) {
    self->is_locked = 0;
    PyThread_release_lock(self->lock);
  }
  return 0;
}

static PyObject *rlock_release(FastRLock *self, PyObject *unused) {
  if (rlock_give(self) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *rlock_exit(FastRLock *self, PyObject *const *args, Py_ssize_t nargs) {
  return rlock_release(self, NULL);
}

static PyObject *rlock_is_owned(FastRLock *self, PyObject *unused) {
  return PyBool_FromLong(self->count > 0 && self->owner == PyThread_get_thread_ident());
}

static PyObject *rlock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
    PyErr_SetString(PyExc_TypeError, "FastRLock() takes no arguments");
    return NULL;
  }
  FastRLock *self = (FastRLock *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->lock = PyThread_allocate_lock();
  if (self->lock == NULL) {
    Py_DECREF(self);
    PyErr_SetString(PyExc_MemoryError, "FastRLock: cannot allocate a lock");
    return NULL;
  }
  return (PyObject *)self;
}

static void rlock_dealloc(FastRLock *self) {
  if (self->lock != NULL) {
    if (self->is_locked) PyThread_release_lock(self->lock);
    PyThread_free_lock(self->lock);
  }
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef rlock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))rlock_acquire, METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool, as threading.RLock.acquire"},
    {"release", (PyCFunction)rlock_release, METH_NOARGS, "release(), as threading.RLock"},
    {"__enter__", (PyCFunction)(void (*)(void))rlock_acquire, METH_FASTCALL | METH_KEYWORDS,
     NULL},
    {"__exit__", (PyCFunction)(void (*)(void))rlock_exit, METH_FASTCALL, NULL},
    {"_is_owned", (PyCFunction)rlock_is_owned, METH_NOARGS,
     "whether the calling thread holds the lock"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject FastRLockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "needle.memory._trusted_pair.FastRLock",
    .tp_basicsize = sizeof(FastRLock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "FastRLock(): a re-entrant lock with threading.RLock's acquire/release/with.",
    .tp_new = rlock_new,
    .tp_dealloc = (destructor)rlock_dealloc,
    .tp_methods = rlock_methods,
};

static PyObject *keys[N_KEYS];

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject *allocator;     /* the CachingAllocator */
  PyObject *fields;        /* its __dict__ */
  CategoryRow *all;        /* allocator._all */
  ParkCounts *parking;     /* allocator._parking */
  PyObject *by_category;   /* allocator._by_category: name -> CategoryRow */
  FastRLock *lock;         /* allocator._lock */
  PyObject *slow_allocate; /* allocator._allocate_trusted / _release_trusted */
  PyObject *slow_release;
  PyObject *block_type;    /* caching_allocator.Block */
  PyObject *state;         /* categories.thread_state(), a threading.local */
  PyObject *timeline;      /* needle.memory.timeline's __dict__ (its _RECORDERS list) */
  PyObject *default_category;
  Py_ssize_t offsets[N_FIELDS];
  Py_ssize_t round_up;     /* BLOCK_ROUND - 1 */
  int round_shift;         /* log2(BLOCK_ROUND) */
} TrustedPair;

typedef struct {
  PyObject_HEAD
  PyObject *block;
  PyObject *ptr;
  TrustedPair *pair;
} TrustedOwner;

static PyTypeObject TrustedOwnerType;

/* 1 when no thread holds the allocator's lock (the fast paths may run), else 0. */
static inline int lock_free(TrustedPair *self) { return self->lock->count == 0; }

/* ---- small helpers (borrowed references unless said otherwise) ------------------------- */

static inline PyObject *slot_get(PyObject *obj, Py_ssize_t offset) {
  return *(PyObject **)((char *)obj + offset);
}

static inline void slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value) {
  PyObject **p = (PyObject **)((char *)obj + offset);
  PyObject *old = *p;
  Py_INCREF(value);
  *p = value;
  Py_XDECREF(old);
}

/* The int at d[key] as a long long; -1 with *ok = 0 when missing or not an int. */
static inline long long dict_int(PyObject *d, PyObject *key, int *ok) {
  PyObject *v = PyDict_GetItemWithError(d, key);
  if (v == NULL || !PyLong_CheckExact(v)) {
    *ok = 0;
    return -1;
  }
  long long x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) *ok = 0;
  return x;
}

/* categories.resolve(None): the thread's user scope, framework scope, op default, "other".
   Returns a new reference. Reading the threading.local's __dict__ may run its __init__ (a
   thread's first read), so this runs before the lock is taken. */
static PyObject *resolve_category(TrustedPair *self) {
  PyObject *fields = PyObject_GetAttr(self->state, keys[K_DICT]);
  if (fields == NULL) return NULL;
  PyObject *cat = NULL;
  for (int k = K_USER_TOP; k <= K_OP_CATEGORY && cat == NULL; ++k) {
    PyObject *v = PyDict_GetItemWithError(fields, keys[k]);
    if (v == NULL && PyErr_Occurred()) {
      Py_DECREF(fields);
      return NULL;
    }
    if (v != NULL && v != Py_None) {
      int truth = PyObject_IsTrue(v);
      if (truth < 0) {
        Py_DECREF(fields);
        return NULL;
      }
      if (truth) cat = v;
    }
  }
  if (cat == NULL) cat = self->default_category;
  Py_INCREF(cat);
  Py_DECREF(fields);
  return cat;
}

static int recorders_listening(TrustedPair *self) {
  PyObject *rec = PyDict_GetItemWithError(self->timeline, keys[K_RECORDERS]);
  if (rec == NULL) return PyErr_Occurred() ? -1 : 0;
  return PyObject_IsTrue(rec);
}

static PyObject *make_owner(TrustedPair *pair, PyObject *block) {
  /* block.segment.base + block.offset, as DeviceBlock does */
  PyObject *segment = slot_get(block, pair->offsets[F_SEGMENT]);
  PyObject *offset = slot_get(block, pair->offsets[F_OFFSET]);
  if (segment == NULL || offset == NULL) {
    PyErr_SetString(PyExc_AttributeError, "trusted pair: block without segment or offset");
    return NULL;
  }
  PyObject *base = PyObject_GetAttr(segment, keys[K_BASE]);
  if (base == NULL) return NULL;
  PyObject *ptr = PyNumber_Add(base, offset);
  Py_DECREF(base);
  if (ptr == NULL) return NULL;
  TrustedOwner *owner = PyObject_New(TrustedOwner, &TrustedOwnerType);
  if (owner == NULL) {
    Py_DECREF(ptr);
    return NULL;
  }
  Py_INCREF(block);
  Py_INCREF(pair);
  owner->block = block;
  owner->ptr = ptr;
  owner->pair = pair;
  return (PyObject *)owner;
}

/* ---- allocate ------------------------------------------------------------------------- */

/* The parked block for `nbytes`, counted as _allocate_trusted counts it (a new reference);
   NULL without an error when the Python path must serve the request. */
static PyObject *take_parked(TrustedPair *self, Py_ssize_t nbytes, PyObject *nbytes_obj,
                             PyObject *cat) {
  PyObject *d = self->fields;
  Py_ssize_t k = (nbytes + self->round_up) >> self->round_shift;
  PyObject *key = PyLong_FromSsize_t(k ? k : 1);
  if (key == NULL) return NULL;
  PyObject *block = NULL;
  int ok = 1;
  PyObject *parked = PyDict_GetItemWithError(d, keys[K_PARKED]);
  PyObject *stack = parked && PyDict_CheckExact(parked)
                        ? PyDict_GetItemWithError(parked, key) : NULL;
  Py_DECREF(key);
  if (PyErr_Occurred()) return NULL;
  if (stack == NULL || !PyList_CheckExact(stack) || PyList_GET_SIZE(stack) == 0) return NULL;
  if (dict_int(d, keys[K_DEPTH], &ok) != 0 || !ok) return NULL;
  int listening = recorders_listening(self);
  if (listening != 0) return NULL;  /* the Python path emits the event (or the error) */
  Py_ssize_t last = PyList_GET_SIZE(stack) - 1;
  block = PyList_GET_ITEM(stack, last);
  if (Py_TYPE(block) != (PyTypeObject *)self->block_type) return NULL;
  PyObject *size_obj = slot_get(block, self->offsets[F_SIZE]);
  if (size_obj == NULL || !PyLong_CheckExact(size_obj)) return NULL;
  long long size = PyLong_AsLongLong(size_obj);
  PyObject *row_obj = PyDict_GetItemWithError(self->by_category, cat);
  if (row_obj == NULL || !Py_IS_TYPE(row_obj, &CategoryRowType)) return NULL;  /* Python's error */
  Py_INCREF(block);
  if (PyList_SetSlice(stack, last, last + 1, NULL) < 0) {  /* stack.pop(): a shrink only */
    Py_DECREF(block);
    return NULL;
  }
  slot_set(block, self->offsets[F_FREE], Py_False);
  slot_set(block, self->offsets[F_REQUESTED], nbytes_obj);
  slot_set(block, self->offsets[F_CATEGORY], cat);
  self->parking->parked_reuses += 1;
  add_bytes(self->all, size, nbytes);
  add_bytes((CategoryRow *)row_obj, size, nbytes);
  return block;
}

static PyObject *pair_allocate(TrustedPair *self, PyObject *nbytes_obj) {
  Py_ssize_t nbytes = -1;
  if (PyLong_CheckExact(nbytes_obj)) {
    nbytes = PyLong_AsSsize_t(nbytes_obj);
    if (nbytes == -1 && PyErr_Occurred()) PyErr_Clear();
  }
  PyObject *block = NULL;
  if (nbytes >= 0 && nbytes <= PY_SSIZE_T_MAX - self->round_up) {
    PyObject *cat = resolve_category(self);
    if (cat == NULL) return NULL;
    if (lock_free(self)) block = take_parked(self, nbytes, nbytes_obj, cat);
    Py_DECREF(cat);
    if (block == NULL && PyErr_Occurred()) return NULL;
  }
  if (block == NULL) {
    block = PyObject_CallOneArg(self->slow_allocate, nbytes_obj);
    if (block == NULL) return NULL;
  }
  PyObject *owner = make_owner(self, block);
  if (owner == NULL) {
    /* hand the block back: the caller never saw it */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *r = PyObject_CallOneArg(self->slow_release, block);
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_Restore(exc_type, exc_value, exc_tb);
  }
  Py_DECREF(block);
  return owner;
}

static PyObject *pair_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_Format(PyExc_TypeError, "TrustedPair: expected one argument (nbytes), got %zd",
                 nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0));
    return NULL;
  }
  return pair_allocate((TrustedPair *)callable, args[0]);
}

/* ---- release -------------------------------------------------------------------------- */

/* Parks `block` as _release_trusted does; 1 when done, 0 when the Python path must do it,
   -1 on an error. */
static int park(TrustedPair *self, PyObject *block) {
  PyObject *d = self->fields;
  if (Py_TYPE(block) != (PyTypeObject *)self->block_type) return 0;
  if (slot_get(block, self->offsets[F_FREE]) != Py_False) return 0;  /* Python raises */
  int ok = 1;
  if (dict_int(d, keys[K_DEPTH], &ok) != 0 || !ok) return 0;  /* deferred by Python */
  PyObject *pending = PyDict_GetItemWithError(d, keys[K_PENDING]);
  if (pending == NULL || !PyList_CheckExact(pending) || PyList_GET_SIZE(pending) != 0)
    return PyErr_Occurred() ? -1 : 0;  /* deferred releases: Python drains them after */
  int listening = recorders_listening(self);
  if (listening != 0) return listening < 0 ? -1 : 0;
  PyObject *size_obj = slot_get(block, self->offsets[F_SIZE]);
  PyObject *req_obj = slot_get(block, self->offsets[F_REQUESTED]);
  PyObject *cat = slot_get(block, self->offsets[F_CATEGORY]);
  if (size_obj == NULL || req_obj == NULL || cat == NULL || !PyLong_CheckExact(size_obj) ||
      !PyLong_CheckExact(req_obj))
    return 0;
  long long size = PyLong_AsLongLong(size_obj);
  Py_ssize_t nbytes = PyLong_AsSsize_t(req_obj);
  if (PyErr_Occurred() || nbytes < 0 || nbytes > PY_SSIZE_T_MAX - self->round_up) {
    PyErr_Clear();
    return 0;
  }
  PyObject *row_obj = PyDict_GetItemWithError(self->by_category, cat);
  PyObject *parked = PyDict_GetItemWithError(d, keys[K_PARKED]);
  if (row_obj == NULL || !Py_IS_TYPE(row_obj, &CategoryRowType) || parked == NULL ||
      !PyDict_CheckExact(parked))
    return PyErr_Occurred() ? -1 : 0;
  slot_set(block, self->offsets[F_FREE], Py_True);
  self->parking->parks += 1;
  take_bytes(self->all, size, nbytes);
  take_bytes((CategoryRow *)row_obj, size, nbytes);
  PyObject *zero = PyLong_FromLong(0);
  if (zero == NULL) return -1;
  slot_set(block, self->offsets[F_REQUESTED], zero);
  Py_DECREF(zero);
  Py_ssize_t k = (nbytes + self->round_up) >> self->round_shift;
  PyObject *key = PyLong_FromSsize_t(k ? k : 1);
  if (key == NULL) return -1;
  /* A new list is a garbage-collected object: making it may run a collection and so a
     destructor that parks a block of this size first. setdefault keeps whichever list is
     there after that; every counter above is already settled. */
  PyObject *stack = PyDict_GetItemWithError(parked, key);
  if (stack == NULL) {
    if (PyErr_Occurred()) {
      Py_DECREF(key);
      return -1;
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) {
      Py_DECREF(key);
      return -1;
    }
    stack = PyDict_SetDefault(parked, key, fresh);
    Py_DECREF(fresh);
  }
  Py_DECREF(key);
  if (stack == NULL || PyList_Append(stack, block) < 0) return -1;
  return 1;
}

/* Release `block` through the fast path or the Python one; sets an error on failure. */
static int pair_release(TrustedPair *self, PyObject *block) {
  int done = lock_free(self) ? park(self, block) : 0;
  if (done < 0) return -1;
  if (done) return 0;
  PyObject *r = PyObject_CallOneArg(self->slow_release, block);
  if (r == NULL) return -1;
  Py_DECREF(r);
  return 0;
}

/* ---- TrustedPair type ----------------------------------------------------------------- */

static int pair_init(TrustedPair *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"allocator", "block_type", "state", "timeline", "default_category",
                           "block_round", NULL};
  PyObject *allocator, *block_type, *state, *timeline, *default_category;
  Py_ssize_t block_round;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOUn", kwlist, &allocator, &block_type,
                                   &state, &timeline, &default_category, &block_round))
    return -1;
  if (block_round <= 0 || (block_round & (block_round - 1)) != 0) {
    PyErr_Format(PyExc_ValueError,
                 "TrustedPair: expected block_round a power of two, got %zd", block_round);
    return -1;
  }
  if (!PyType_Check(block_type)) {
    PyErr_Format(PyExc_TypeError, "TrustedPair: expected block_type a class, got %R",
                 block_type);
    return -1;
  }
  for (int f = 0; f < N_FIELDS; ++f) {
    PyObject *descr = PyObject_GetAttrString(block_type, FIELD_NAMES[f]);
    if (descr == NULL) return -1;
    int is_slot = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                  ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
    if (is_slot) self->offsets[f] = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    if (!is_slot) {
      PyErr_Format(PyExc_TypeError, "TrustedPair: expected %R.%s to be a __slots__ field",
                   block_type, FIELD_NAMES[f]);
      return -1;
    }
  }
  PyObject *fields = PyObject_GenericGetDict(allocator, NULL);
  if (fields == NULL) return -1;
  PyObject *timeline_dict = PyObject_GetAttr(timeline, keys[K_DICT]);
  if (timeline_dict == NULL || !PyDict_Check(timeline_dict)) {
    Py_DECREF(fields);
    Py_XDECREF(timeline_dict);
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "TrustedPair: expected the timeline module");
    return -1;
  }
  PyObject *all = PyObject_GetAttrString(allocator, "_all");
  PyObject *parking = PyObject_GetAttrString(allocator, "_parking");
  PyObject *by_category = PyObject_GetAttrString(allocator, "_by_category");
  if (all == NULL || parking == NULL || by_category == NULL ||
      !Py_IS_TYPE(all, &CategoryRowType) || !Py_IS_TYPE(parking, &ParkCountsType) ||
      !PyDict_CheckExact(by_category)) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_TypeError,
                   "TrustedPair: expected the allocator's _all a %s, _parking a %s and "
                   "_by_category a dict, got %R, %R and %R", CategoryRowType.tp_name,
                   ParkCountsType.tp_name, all, parking, by_category);
    Py_XDECREF(all);
    Py_XDECREF(parking);
    Py_XDECREF(by_category);
    Py_DECREF(fields);
    Py_DECREF(timeline_dict);
    return -1;
  }
  PyObject *lock = PyObject_GetAttrString(allocator, "_lock");
  if (lock != NULL && !Py_IS_TYPE(lock, &FastRLockType)) {
    PyErr_Format(PyExc_TypeError, "TrustedPair: expected the allocator's _lock a %s, got %R",
                 FastRLockType.tp_name, lock);
    Py_CLEAR(lock);
  }
  PyObject *slow_allocate = PyObject_GetAttrString(allocator, "_allocate_trusted");
  PyObject *slow_release = PyObject_GetAttrString(allocator, "_release_trusted");
  if (!lock || !slow_allocate || !slow_release) {
    Py_DECREF(all);
    Py_DECREF(parking);
    Py_DECREF(by_category);
    Py_DECREF(fields);
    Py_DECREF(timeline_dict);
    Py_XDECREF(lock);
    Py_XDECREF(slow_allocate);
    Py_XDECREF(slow_release);
    return -1;
  }
  Py_INCREF(allocator);
  Py_INCREF(block_type);
  Py_INCREF(state);
  Py_INCREF(default_category);
  Py_XSETREF(self->allocator, allocator);
  Py_XSETREF(self->fields, fields);
  Py_XSETREF(self->all, (CategoryRow *)all);
  Py_XSETREF(self->parking, (ParkCounts *)parking);
  Py_XSETREF(self->by_category, by_category);
  Py_XSETREF(self->lock, (FastRLock *)lock);
  Py_XSETREF(self->slow_allocate, slow_allocate);
  Py_XSETREF(self->slow_release, slow_release);
  Py_XSETREF(self->block_type, block_type);
  Py_XSETREF(self->state, state);
  Py_XSETREF(self->timeline, timeline_dict);
  Py_XSETREF(self->default_category, default_category);
  self->round_up = block_round - 1;
  self->round_shift = 0;
  while (((Py_ssize_t)1 << self->round_shift) < block_round) ++self->round_shift;
  self->vectorcall = pair_vectorcall;
  return 0;
}

/* Every object field of TrustedPair, for traverse and clear. */
#define PAIR_OBJECTS(X)                                                                  \
  X(allocator) X(fields) X(all) X(parking) X(by_category) X(lock) X(slow_allocate)       \
  X(slow_release) X(block_type) X(state) X(timeline) X(default_category)

static int pair_traverse(TrustedPair *self, visitproc visit, void *arg) {
#define VISIT_FIELD(name) Py_VISIT(self->name);
  PAIR_OBJECTS(VISIT_FIELD)
#undef VISIT_FIELD
  return 0;
}

static int pair_clear(TrustedPair *self) {
#define CLEAR_FIELD(name) Py_CLEAR(self->name);
  PAIR_OBJECTS(CLEAR_FIELD)
#undef CLEAR_FIELD
  return 0;
}

static void pair_dealloc(TrustedPair *self) {
  PyObject_GC_UnTrack(self);
  pair_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *pair_call(PyObject *self, PyObject *args, PyObject *kwds) {
  return PyVectorcall_Call(self, args, kwds);
}

static PyMemberDef pair_members[] = {
    {"allocator", T_OBJECT_EX, offsetof(TrustedPair, allocator), READONLY,
     "the CachingAllocator served"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject TrustedPairType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "needle.memory._trusted_pair.TrustedPair",
    .tp_basicsize = sizeof(TrustedPair),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "TrustedPair(allocator, block_type, state, timeline, default_category, "
              "block_round): pair(nbytes) -> TrustedOwner over a block of the allocator.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pair_init,
    .tp_dealloc = (destructor)pair_dealloc,
    .tp_traverse = (traverseproc)pair_traverse,
    .tp_clear = (inquiry)pair_clear,
    .tp_call = pair_call,
    .tp_vectorcall_offset = offsetof(TrustedPair, vectorcall),
    .tp_members = pair_members,
};

/* ---- TrustedOwner type ---------------------------------------------------------------- */

static void owner_dealloc(TrustedOwner *self) {
  PyObject *exc_type, *exc_value, *exc_tb;
  PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
  if (self->pair != NULL && self->block != NULL && pair_release(self->pair, self->block) < 0)
    PyErr_Clear();  /* as DeviceBlock.__del__: a torn-down allocator at exit is not an error */
  PyErr_Restore(exc_type, exc_value, exc_tb);
  Py_CLEAR(self->block);
  Py_CLEAR(self->ptr);
  Py_CLEAR(self->pair);
  PyObject_Free(self);
}

static PyObject *owner_repr(TrustedOwner *self) {
  return PyUnicode_FromFormat("TrustedOwner(ptr=%R, block=%R)", self->ptr, self->block);
}

static PyMemberDef owner_members[] = {
    {"block", T_OBJECT_EX, offsetof(TrustedOwner, block), READONLY,
     "the allocator's Block, live while this owner is"},
    {"ptr", T_OBJECT_EX, offsetof(TrustedOwner, ptr), READONLY, "the device address (int)"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject TrustedOwnerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "needle.memory._trusted_pair.TrustedOwner",
    .tp_basicsize = sizeof(TrustedOwner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What the CUDA backend holds for one buffer: ptr, and the block until dropped.",
    .tp_dealloc = (destructor)owner_dealloc,
    .tp_repr = (reprfunc)owner_repr,
    .tp_members = owner_members,
};

/* ---- the counters' types ------------------------------------------------------------ */

#define COUNTER(type, name, doc) {#name, T_LONGLONG, offsetof(type, name), 0, doc}

static PyMemberDef park_members[] = {
    COUNTER(ParkCounts, parked_reuses, "allocations served by a parked block"),
    COUNTER(ParkCounts, parks, "releases that parked their block"),
    {NULL, 0, 0, 0, NULL}};

static PyMemberDef row_members[] = {
    COUNTER(CategoryRow, current, "bytes in live blocks (of the category, or all)"),
    COUNTER(CategoryRow, peak, "most of them since the last reset_peak"),
    COUNTER(CategoryRow, current_requested, "bytes asked for by them"),
    COUNTER(CategoryRow, peak_requested, "most of those since the last reset_peak"),
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject ParkCountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "needle.memory._trusted_pair.ParkCounts",
    .tp_basicsize = sizeof(ParkCounts),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ParkCounts(): the parked pair's events, both 0.",
    .tp_new = PyType_GenericNew,
    .tp_members = park_members,
};

static PyTypeObject CategoryRowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "needle.memory._trusted_pair.CategoryRow",
    .tp_basicsize = sizeof(CategoryRow),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CategoryRow(): bytes of live blocks and their peaks, all 0.",
    .tp_new = PyType_GenericNew,
    .tp_members = row_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_trusted_pair",
    "The CUDA backend's per-buffer allocate/release pair in C (see src/trusted_pair.c).", -1,
    NULL};

PyMODINIT_FUNC PyInit__trusted_pair(void) {
  for (int k = 0; k < N_KEYS; ++k) {
    if (keys[k] == NULL && (keys[k] = PyUnicode_InternFromString(KEY_NAMES[k])) == NULL)
      return NULL;
  }
  if (PyType_Ready(&TrustedPairType) < 0 || PyType_Ready(&TrustedOwnerType) < 0 ||
      PyType_Ready(&FastRLockType) < 0 ||
      PyType_Ready(&ParkCountsType) < 0 || PyType_Ready(&CategoryRowType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  Py_INCREF(&TrustedPairType);
  Py_INCREF(&TrustedOwnerType);
  Py_INCREF(&ParkCountsType);
  Py_INCREF(&FastRLockType);
  Py_INCREF(&CategoryRowType);
  if (PyModule_AddObject(m, "TrustedPair", (PyObject *)&TrustedPairType) < 0 ||
      PyModule_AddObject(m, "TrustedOwner", (PyObject *)&TrustedOwnerType) < 0 ||
      PyModule_AddObject(m, "ParkCounts", (PyObject *)&ParkCountsType) < 0 ||
      PyModule_AddObject(m, "FastRLock", (PyObject *)&FastRLockType) < 0 ||
      PyModule_AddObject(m, "CategoryRow", (PyObject *)&CategoryRowType) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
