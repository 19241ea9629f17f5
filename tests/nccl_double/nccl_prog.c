/*
 * A one-rank NCCL program, run under the hook against the test double.
 * usage: nccl_prog ID_FILE ITERATIONS [MODES]
 * ID_FILE holds the 128-byte ncclUniqueId (created if missing), so two processes
 * can share one. Prints "ok" and exits 0 when every result is right.
 *
 * After every NCCL call the thread's last CUDA error must still be cudaSuccess,
 * as PyTorch's check after its next kernel launch requires. MODES adds, after the
 * iterations: "p", an NCCL call made while the program's own CUDA error is
 * pending, which must still be pending afterwards; "c", NCCL calls captured into
 * a CUDA graph, whose capture must succeed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nccl.h>

/* CUDA runtime calls (the double in cudart_double.c; values as in cuda_runtime_api.h). */
int cudaPeekAtLastError(void);
int cudaGetLastError(void);
int cudaEventQuery(void *event);
int cudaStreamBeginCapture(void *stream, int mode);
int cudaStreamEndCapture(void *stream, void **graph);
#define CUDA_ERROR_INVALID_RESOURCE_HANDLE 400
#define CUDA_CAPTURE_MODE_GLOBAL 0

#define N 256
#define CHECK(x) do { ncclResult_t r_ = (x); int e_; if (r_ != ncclSuccess) { \
	fprintf(stderr, "%s: %d\n", #x, r_); return 1; } \
	if ((e_ = cudaPeekAtLastError()) != 0) { \
	fprintf(stderr, "%s left CUDA error %d\n", #x, e_); return 5; } } while (0)

/* The ncclUniqueId shared through the file at `path`: read, or made and written. */
static int shared_id(const char *path, ncclUniqueId *id)
{
	FILE *f = fopen(path, "rb");

	if (f) {
		if (fread(id, sizeof(*id), 1, f) != 1)
			return 2;
		fclose(f);
		return 0;
	}
	CHECK(ncclGetUniqueId(id));
	f = fopen(path, "wb");
	if (!f || fwrite(id, sizeof(*id), 1, f) != 1)
		return 2;
	fclose(f);
	return 0;
}

/* One iteration: every collective, then a grouped send/recv to itself. a and b hold
 * N floats, d N / 2 doubles. */
static int iteration(ncclComm_t comm, int it, float *a, float *b, double *d)
{
	for (int i = 0; i < N; i++)
		a[i] = (float)(i + it), b[i] = -1;
	CHECK(ncclAllReduce(a, b, N, ncclFloat32, ncclSum, comm, NULL));
	for (int i = 0; i < N; i++)
		if (b[i] != (float)(i + it))
			return 3;
	CHECK(ncclReduceScatter(a, b, N / 2, ncclFloat32, ncclSum, comm, NULL));
	CHECK(ncclAllGather(a, b, N / 4, ncclFloat32, comm, NULL));
	CHECK(ncclBroadcast(a, b, 10, ncclInt8, 0, comm, NULL));
	CHECK(ncclBcast(d, N / 2, ncclFloat64, 0, comm, NULL));
	CHECK(ncclReduce(a, b, 3, ncclInt64, ncclMax, 0, comm, NULL));
	memset(b, 0, N * sizeof(*b));
	CHECK(ncclGroupStart());
	CHECK(ncclSend(a, 8, ncclFloat32, 0, comm, NULL));
	CHECK(ncclRecv(b, 8, ncclFloat32, 0, comm, NULL));
	CHECK(ncclGroupEnd());
	for (int i = 0; i < 8; i++)
		if (b[i] != a[i])
			return 4;
	return 0;
}

/* MODES "p": the program's own error (a bad handle), pending across an NCCL call. */
static int pending_error_kept(ncclComm_t comm, float *a, float *b)
{
	int err;

	if (cudaEventQuery(NULL) != CUDA_ERROR_INVALID_RESOURCE_HANDLE)
		return 2;
	if (ncclAllReduce(a, b, N, ncclFloat32, ncclSum, comm, NULL) != ncclSuccess)
		return 1;
	err = cudaGetLastError();
	if (err != CUDA_ERROR_INVALID_RESOURCE_HANDLE) {
		fprintf(stderr, "pending CUDA error %d became %d\n",
			CUDA_ERROR_INVALID_RESOURCE_HANDLE, err);
		return 8;
	}
	return 0;
}

/* MODES "c": three AllReduces captured into a CUDA graph, then one outside it. */
static int graph_capture(ncclComm_t comm, float *a, float *b)
{
	static char stream_object;
	void *graph = NULL, *capture_stream = &stream_object; /* any non-null handle */
	int err;

	if (cudaStreamBeginCapture(capture_stream, CUDA_CAPTURE_MODE_GLOBAL) != 0)
		return 2;
	for (int i = 0; i < 3; i++)
		CHECK(ncclAllReduce(a, b, N, ncclFloat32, ncclSum, comm, capture_stream));
	err = cudaStreamEndCapture(capture_stream, &graph);
	if (err != 0 || !graph) {
		fprintf(stderr, "graph capture failed: CUDA error %d\n", err);
		return 7;
	}
	CHECK(ncclAllReduce(a, b, N, ncclFloat32, ncclSum, comm, NULL));
	return 0;
}

int main(int argc, char **argv)
{
	float a[N], b[N];
	double d[N / 2];
	ncclUniqueId id;
	ncclComm_t comm, sub, none;
	int iters = argc > 2 ? atoi(argv[2]) : 1;
	const char *modes = argc > 3 ? argv[3] : "";
	int rc;

	if (argc < 2)
		return 2;
	if ((rc = shared_id(argv[1], &id)) != 0)
		return rc;
	CHECK(ncclCommInitRank(&comm, 1, id, 0));
	for (int it = 0; it < iters; it++)
		if ((rc = iteration(comm, it, a, b, d)) != 0)
			return rc;
	if (strchr(modes, 'p') && (rc = pending_error_kept(comm, a, b)) != 0)
		return rc;
	if (strchr(modes, 'c') && (rc = graph_capture(comm, a, b)) != 0)
		return rc;
	CHECK(ncclCommSplit(comm, 7, 0, &sub, NULL));
	CHECK(ncclAllReduce(a, b, 5, ncclBfloat16, ncclSum, sub, NULL));
	CHECK(ncclCommSplit(comm, NCCL_SPLIT_NOCOLOR, 0, &none, NULL));
	CHECK(ncclCommDestroy(sub));
	CHECK(ncclCommDestroy(comm));
	printf("ok\n");
	return 0;
}
