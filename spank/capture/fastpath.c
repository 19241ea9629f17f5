/*
 * _greyhound_fastpath: the common case of the torch.distributed capture, in C.
 *
 * The capture (greyhound/capture/_greyhound_capture.py) wraps each
 * torch.distributed call in Python. Its budget is 2 us a call, and the code
 * right after a blocking gloo call runs on cold caches, several times slower
 * than in a loop: there the Python wrapper's ~60 bytecodes and two ctypes
 * calls cost ~4 us. This module gives each wrapped function a C callable that
 * handles the common case itself: a blocking call on a process group the
 * capture has already described, sized by tensor.nbytes, with a peer that
 * needs no translation. It calls gh_py_begin_call and gh_py_end_head of the
 * hook directly, with the record head built on the stack. gh_py_begin_call
 * numbers the call as the hook numbers its MPI and NCCL calls (every call the
 * fast path records is a communication call), so that the pause gate holds
 * a torch rank before the same call number as an MPI one (gh_ring.h).
 *
 * Everything else (the first call on a group, async calls, lists of tensors,
 * group-relative peers, any surprise) goes to the Python wrapper, which stays
 * the complete implementation: the fast path decides before gh_py_begin_call, so it
 * never leaves a half-made record, and any error it meets there is cleared and
 * handed to the Python wrapper, which is itself fail-open.
 *
 * It reads the capture's GroupInfo (a named tuple) by position; bind() takes
 * its field names and refuses to bind to a capture whose fields are not the
 * ones read here (see group_info_fields).
 *
 * Built against the stable ABI (Py_LIMITED_API, CPython >= 3.10), so one
 * build loads in whatever Python the job runs. The capture imports it when it
 * can and works without it.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <structmember.h>

#include "../hook/gh_ring.h"
#include "../hook/pyhead.h"

typedef uintptr_t (*gh_begin_fn)(void);
typedef uint64_t (*gh_end_head_fn)(const void *head);

static gh_begin_fn gh_begin;
static gh_end_head_fn gh_end_head;

/*
 * The capture's GroupInfo (a typing.NamedTuple), read here by position. bind()
 * takes its field names and refuses a capture whose fields are not these, in
 * this order.
 */
enum group_info_field {
	GROUP_COMM_ID,
	GROUP_SIZE,
	GROUP_RANK,
	GROUP_SKIP_ALL,
	GROUP_SKIP_CUDA,
	GROUP_HEADS,
	NUM_GROUP_FIELDS
};

static const char *const group_info_fields[NUM_GROUP_FIELDS] = {
	[GROUP_COMM_ID] = "comm_id",
	[GROUP_SIZE] = "size",
	[GROUP_RANK] = "rank",
	[GROUP_SKIP_ALL] = "skip_all",
	[GROUP_SKIP_CUDA] = "skip_cuda",
	[GROUP_HEADS] = "heads",
};

/* Interned attribute and keyword names. */
static PyObject *s_on, *s_groups, *s_gate, *s_world, *s_default_pg, *s_nbytes, *s_is_cuda,
	*s_group, *s_async_op;

typedef struct {
	PyObject_HEAD
	PyObject *fn;       /* the torch.distributed function */
	PyObject *slow;     /* the Python wrapper: every case this one leaves */
	PyObject *hook;     /* the capture's _Hook: .on, .last, .gate() */
	PyObject *dc10d;    /* torch.distributed.distributed_c10d */
	PyObject *size_name, *peer_name, *group_peer_name;   /* str or None */
	Py_ssize_t i_size, i_group, i_async, i_peer, i_group_peer;
	uint32_t op;
	PyObject *dict;     /* __name__, __wrapped__, ... as functools.wraps sets them */
} FastCall;

/* Borrowed: positional argument i, else keyword name, else NULL. */
static PyObject *get_arg(PyObject *args, PyObject *kwargs, Py_ssize_t i, PyObject *name)
{
	if (i >= 0 && i < PyTuple_Size(args))
		return PyTuple_GetItem(args, i);
	if (kwargs && name != Py_None)
		return PyDict_GetItem(kwargs, name);
	return NULL;
}

static int is_given(PyObject *value)
{
	return value && value != Py_None;
}

/*
 * The GroupInfo of the call's group (a new reference) if the Python wrapper has
 * described that group already, else NULL. A group's description comes from
 * hook.groups (id(group) -> (group, GroupInfo)), which the Python wrapper fills
 * on the group's first call; jobs alternate between groups (PP sends, DP
 * all-reduces), so one "last group" would not do. *group: the call's group
 * argument (borrowed; NULL or None for the default group).
 */
static PyObject *known_group_info(FastCall *self, PyObject *args, PyObject *kwargs, PyObject **group)
{
	PyObject *pg = NULL, *world = NULL, *groups = NULL, *key = NULL, *entry, *info = NULL;

	*group = get_arg(args, kwargs, self->i_group, s_group);
	if (is_given(*group)) {
		pg = *group;
		Py_INCREF(pg);
	} else {
		world = PyObject_GetAttr(self->dc10d, s_world);
		pg = world ? PyObject_GetAttr(world, s_default_pg) : NULL;
		if (!pg || pg == Py_None)
			goto out;
	}
	groups = PyObject_GetAttr(self->hook, s_groups);
	key = PyLong_FromVoidPtr(pg);   /* id(group) */
	if (!groups || !key || !PyDict_Check(groups))
		goto out;
	entry = PyDict_GetItem(groups, key);
	if (!entry || !PyTuple_Check(entry) || PyTuple_Size(entry) != 2 || PyTuple_GetItem(entry, 0) != pg)
		goto out;   /* a group met for the first time: described in Python */
	info = PyTuple_GetItem(entry, 1);
	if (info && PyTuple_Check(info) && PyTuple_Size(info) == NUM_GROUP_FIELDS)
		Py_INCREF(info);
	else
		info = NULL;
out:
	Py_XDECREF(world);
	Py_XDECREF(pg);
	Py_XDECREF(groups);
	Py_XDECREF(key);
	return info;
}

/*
 * *nbytes: the bytes of the call's tensor (tensor.nbytes; 0 without one).
 * 1 (record), 0 (a CUDA tensor the C hook records: call fn unrecorded),
 * -1 (leave it to the Python wrapper).
 */
static int call_bytes(FastCall *self, PyObject *args, PyObject *kwargs, PyObject *info,
		      long long *nbytes)
{
	PyObject *tensor, *value;
	int flag;

	*nbytes = 0;
	tensor = self->size_name != Py_None ? get_arg(args, kwargs, self->i_size, self->size_name) : NULL;
	if (!is_given(tensor))
		return 1;
	if (PyObject_IsTrue(PyTuple_GetItem(info, GROUP_SKIP_CUDA)) == 1) {
		value = PyObject_GetAttr(tensor, s_is_cuda);
		flag = value ? PyObject_IsTrue(value) : -1;
		Py_XDECREF(value);
		if (flag)
			return flag > 0 ? 0 : -1;
	}
	value = PyObject_GetAttr(tensor, s_nbytes);
	*nbytes = value ? PyLong_AsLongLong(value) : -1;
	Py_XDECREF(value);
	return *nbytes < 0 ? -1 : 1;
}

/*
 * *peer: the call's peer or root as a rank in its group, -1 if none. 0, or -1
 * to leave the call to the Python wrapper (a global rank in a subgroup needs
 * get_group_rank; a value that is no rank).
 */
static int call_peer(FastCall *self, PyObject *args, PyObject *kwargs, PyObject *group, long *peer)
{
	PyObject *peer_obj;

	*peer = -1;
	if (self->peer_name == Py_None)
		return 0;
	peer_obj = get_arg(args, kwargs, self->i_group_peer, self->group_peer_name);
	if (!is_given(peer_obj)) {
		peer_obj = get_arg(args, kwargs, self->i_peer, self->peer_name);
		if (is_given(peer_obj) && is_given(group))
			return -1;
	}
	if (!is_given(peer_obj))
		return 0;
	*peer = PyLong_AsLong(peer_obj);
	return PyErr_Occurred() || *peer < 0 || *peer > INT32_MAX ? -1 : 0;
}

/*
 * Fills *head for this call if the fast path can record it: 1 (record),
 * 0 (call fn unrecorded, as the Python wrapper would), -1 (leave it to the
 * Python wrapper). Never leaves an exception set.
 */
static int plan(FastCall *self, PyObject *args, PyObject *kwargs, struct gh_py_head *head)
{
	PyObject *on, *group, *info = NULL, *value;
	long long nbytes;
	long peer;
	int ret = -1, flag;

	on = PyObject_GetAttr(self->hook, s_on);
	if (on != Py_True)
		goto out;
	info = known_group_info(self, args, kwargs, &group);
	if (!info)
		goto out;
	head->comm_id = PyLong_AsUnsignedLongLong(PyTuple_GetItem(info, GROUP_COMM_ID));
	if (PyErr_Occurred())
		goto out;
	flag = PyObject_IsTrue(PyTuple_GetItem(info, GROUP_SKIP_ALL));
	if (flag) {
		ret = flag > 0 ? 0 : -1;
		goto out;
	}
	ret = call_bytes(self, args, kwargs, info, &nbytes);
	if (ret != 1)
		goto out;
	ret = -1;
	if (call_peer(self, args, kwargs, group, &peer) < 0)
		goto out;
	/* recv from any source: the sender comes back as the result, in Python. */
	if (self->op == GH_OP_RECV && peer == -1)
		goto out;
	value = get_arg(args, kwargs, self->i_async, s_async_op);
	if (value && PyObject_IsTrue(value) != 0)
		goto out;   /* async: its Work's wait writes a WAIT record, in Python */
	head->op = self->op;
	head->flags = 0;
	head->peer = (int32_t)peer;
	head->reserved = 0;
	head->size_bytes = (uint64_t)nbytes;
	head->req_id = 0;
	ret = 1;
out:
	Py_XDECREF(on);
	Py_XDECREF(info);
	PyErr_Clear();
	return ret;
}

static PyObject *fastcall_call(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	FastCall *self = (FastCall *)obj;
	struct gh_py_head head;
	uintptr_t begun;
	PyObject *result, *gated;
	int how;

	if (!gh_begin || !gh_end_head)
		return PyObject_Call(self->slow, args, kwargs);
	how = plan(self, args, kwargs, &head);
	if (how < 0)
		return PyObject_Call(self->slow, args, kwargs);
	if (how == 0)
		return PyObject_Call(self->fn, args, kwargs);
	begun = gh_begin();     /* 0: inside another captured call on this thread */
	if (!begun)
		return PyObject_Call(self->fn, args, kwargs);
	if (begun & 1) {        /* the pause gate holds this call: wait there (GIL released) */
		gated = PyObject_CallMethodObjArgs(self->hook, s_gate, NULL);
		Py_XDECREF(gated);
		PyErr_Clear();      /* a gate that fails lets the call go on */
	}
	result = PyObject_Call(self->fn, args, kwargs);
	if (!result)
		head.flags = GH_F_ERROR;
	gh_end_head(&head);     /* takes t_end and writes the record */
	return result;
}

static int fastcall_init(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	static char *kwlist[] = {"fn", "slow", "hook", "dc10d", "op", "size_name", "i_size",
				 "i_group", "i_async", "peer_name", "i_peer", "group_peer_name",
				 "i_group_peer", NULL};
	FastCall *self = (FastCall *)obj;
	PyObject *fn, *slow, *hook, *dc10d, *size_name, *peer_name, *group_peer_name;
	unsigned int op;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOOIOnnnOnOn", kwlist, &fn, &slow, &hook,
					 &dc10d, &op, &size_name, &self->i_size, &self->i_group,
					 &self->i_async, &peer_name, &self->i_peer, &group_peer_name,
					 &self->i_group_peer))
		return -1;
	if (!PyCallable_Check(fn) || !PyCallable_Check(slow)) {
		PyErr_SetString(PyExc_TypeError, "fn and slow must be callable");
		return -1;
	}
	self->op = op;
#define SET(field, value) do { PyObject *old_ = self->field; Py_INCREF(value); self->field = value; Py_XDECREF(old_); } while (0)
	SET(fn, fn);
	SET(slow, slow);
	SET(hook, hook);
	SET(dc10d, dc10d);
	SET(size_name, size_name);
	SET(peer_name, peer_name);
	SET(group_peer_name, group_peer_name);
#undef SET
	return 0;
}

static int fastcall_traverse(PyObject *obj, visitproc visit, void *arg)
{
	FastCall *self = (FastCall *)obj;

	Py_VISIT(Py_TYPE(obj));
	Py_VISIT(self->fn);
	Py_VISIT(self->slow);
	Py_VISIT(self->hook);
	Py_VISIT(self->dc10d);
	Py_VISIT(self->dict);
	return 0;
}

static int fastcall_clear(PyObject *obj)
{
	FastCall *self = (FastCall *)obj;

	Py_CLEAR(self->fn);
	Py_CLEAR(self->slow);
	Py_CLEAR(self->hook);
	Py_CLEAR(self->dc10d);
	Py_CLEAR(self->size_name);
	Py_CLEAR(self->peer_name);
	Py_CLEAR(self->group_peer_name);
	Py_CLEAR(self->dict);
	return 0;
}

static void fastcall_dealloc(PyObject *obj)
{
	PyTypeObject *type = Py_TYPE(obj);
	freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);

	PyObject_GC_UnTrack(obj);
	fastcall_clear(obj);
	tp_free(obj);
	Py_DECREF(type);
}

static PyMemberDef fastcall_members[] = {
	{"__dictoffset__", T_PYSSIZET, offsetof(FastCall, dict), READONLY, NULL},
	{NULL, 0, 0, 0, NULL},
};

static PyType_Slot fastcall_slots[] = {
	{Py_tp_doc, (void *)"A torch.distributed function, recorded: the common case in C, "
			    "the rest through the capture's Python wrapper."},
	{Py_tp_new, (void *)PyType_GenericNew},
	{Py_tp_init, (void *)fastcall_init},
	{Py_tp_call, (void *)fastcall_call},
	{Py_tp_traverse, (void *)fastcall_traverse},
	{Py_tp_clear, (void *)fastcall_clear},
	{Py_tp_dealloc, (void *)fastcall_dealloc},
	{Py_tp_members, fastcall_members},
	{0, NULL},
};

static PyType_Spec fastcall_spec = {
	.name = "_greyhound_fastpath.FastCall",
	.basicsize = sizeof(FastCall),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
	.slots = fastcall_slots,
};

/* 0 if fields (a tuple of str) names group_info_fields in order, else -1 with an error set. */
static int check_group_info_fields(PyObject *fields)
{
	PyObject *expected, *name;
	int same = PyTuple_Check(fields) && PyTuple_Size(fields) == NUM_GROUP_FIELDS;

	for (Py_ssize_t i = 0; same && i < NUM_GROUP_FIELDS; i++) {
		name = PyTuple_GetItem(fields, i);
		same = name && PyUnicode_Check(name) &&
		       PyUnicode_CompareWithASCIIString(name, group_info_fields[i]) == 0;
	}
	if (same)
		return 0;
	PyErr_Clear();
	expected = PyTuple_New(NUM_GROUP_FIELDS);
	for (Py_ssize_t i = 0; expected && i < NUM_GROUP_FIELDS; i++) {
		name = PyUnicode_FromString(group_info_fields[i]);
		if (!name || PyTuple_SetItem(expected, i, name) < 0) {
			Py_CLEAR(expected);
			break;
		}
	}
	if (expected) {
		PyErr_Format(PyExc_ValueError, "the capture's GroupInfo fields are %R, but this fast path "
			     "reads %R: rebuild it with the capture it is installed with", fields, expected);
		Py_DECREF(expected);
	}
	return -1;
}

/*
 * bind(begin, end_head, group_info_fields): the addresses of the hook's
 * gh_py_begin_call (or, from a hook before call numbers, gh_py_begin: same
 * signature) and gh_py_end_head, and the capture's GroupInfo._fields.
 */
static PyObject *bind(PyObject *module, PyObject *args)
{
	unsigned long long begin, end_head;
	PyObject *fields;

	(void)module;
	if (!PyArg_ParseTuple(args, "KKO", &begin, &end_head, &fields))
		return NULL;
	if (check_group_info_fields(fields) < 0)
		return NULL;
	if (!begin || !end_head) {
		PyErr_SetString(PyExc_ValueError, "bind() needs the addresses of gh_py_begin_call and gh_py_end_head");
		return NULL;
	}
	gh_begin = (gh_begin_fn)(uintptr_t)begin;
	gh_end_head = (gh_end_head_fn)(uintptr_t)end_head;
	Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
	{"bind", bind, METH_VARARGS,
	 "bind(begin, end_head, group_info_fields): the hook's gh_py_begin_call and gh_py_end_head, "
	 "and the capture's GroupInfo._fields (checked)."},
	{NULL, NULL, 0, NULL},
};

static int intern_names(void)
{
	struct {
		PyObject **slot;
		const char *text;
	} names[] = {
		{&s_on, "on"}, {&s_groups, "groups"}, {&s_gate, "gate"}, {&s_world, "_world"},
		{&s_default_pg, "_default_pg"}, {&s_nbytes, "nbytes"}, {&s_is_cuda, "is_cuda"},
		{&s_group, "group"}, {&s_async_op, "async_op"},
	};

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		if (!*names[i].slot && !(*names[i].slot = PyUnicode_InternFromString(names[i].text)))
			return -1;
	}
	return 0;
}

static struct PyModuleDef module_def = {
	PyModuleDef_HEAD_INIT,
	.m_name = "_greyhound_fastpath",
	.m_doc = "The torch.distributed capture's common case in C (see fastpath.c).",
	.m_size = -1,
	.m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__greyhound_fastpath(void)
{
	PyObject *module, *type;

	if (intern_names() < 0)
		return NULL;
	module = PyModule_Create(&module_def);
	if (!module)
		return NULL;
	type = PyType_FromSpec(&fastcall_spec);
	if (!type)
		goto fail;
	if (PyModule_AddObject(module, "FastCall", type) < 0) {
		Py_DECREF(type);
		goto fail;
	}
	return module;
fail:
	Py_DECREF(module);
	return NULL;
}
