/* Open MPI baseline for gather_perf / scatter_accumulate_perf: MPI_Allgather
 * (out of place and MPI_IN_PLACE) and MPI_Reduce_scatter_block (sum), timed
 * like the perf binaries: barrier, operation, barrier; a row's time is the
 * slowest rank's mean. Sizes and bandwidths follow nccl-tests (and the perf
 * binaries): `size` is the gathered buffer or the reduce-scatter input,
 * algbw = size / time, busbw = algbw * (n - 1) / n, GB = 1e9 B.
 *
 *   mpicc -O2 -o mpi_baseline mpi_baseline.c
 *   mpirun -np 2 ./mpi_baseline -b 64K -e 64M -f 4 -n 20 -w 5
 *
 * Results are checked (integer-valued floats); #wrong counts bad elements.
 * Built and run by scripts/mpi-baseline.sh; not part of `make test`.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t parse_size(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    switch (end && *end ? *end : ' ') {
    case 'K': case 'k': v *= 1024.0; break;
    case 'M': case 'm': v *= 1024.0 * 1024.0; break;
    case 'G': case 'g': v *= 1024.0 * 1024.0 * 1024.0; break;
    default: break;
    }
    return (size_t)v;
}

typedef enum { AG_OUT, AG_IN, RS } op_t;

/* Runs `iters` timed operations after `warmup` untimed ones; returns the
 * slowest rank's mean seconds and sets *wrong to the bad elements (summed). */
static double run(op_t op, size_t count, int iters, int warmup, long *wrong) {
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t per = count / (size_t)n; /* elements per rank */
    float *in = malloc((op == RS ? count : per) * sizeof(float));
    float *out = malloc((op == RS ? per : count) * sizeof(float));
    if (!in || !out) {
        fprintf(stderr, "rank %d: out of memory at %zu elements\n", rank, count);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    double total = 0.0;
    long bad = 0;
    for (int it = 0; it < warmup + iters; it++) {
        if (op == RS) {
            for (size_t i = 0; i < count; i++) in[i] = (float)((rank + 1) * (int)(i % 251));
        } else if (op == AG_OUT) {
            for (size_t i = 0; i < per; i++) in[i] = (float)(rank * 1000 + (int)(i % 997));
        } else {
            for (size_t i = 0; i < per; i++) out[rank * per + i] = (float)(rank * 1000 + (int)(i % 997));
        }
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        if (op == AG_OUT)
            MPI_Allgather(in, (int)per, MPI_FLOAT, out, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
        else if (op == AG_IN)
            MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
        else
            MPI_Reduce_scatter_block(in, out, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double dt = MPI_Wtime() - t0;
        MPI_Barrier(MPI_COMM_WORLD);
        if (it >= warmup) total += dt;
        if (it == warmup + iters - 1) {
            if (op == RS) {
                float ranks_sum = (float)(n * (n + 1) / 2);
                for (size_t i = 0; i < per; i++) {
                    size_t g = (size_t)rank * per + i;
                    if (out[i] != ranks_sum * (float)(int)(g % 251)) bad++;
                }
            } else {
                for (int r = 0; r < n; r++)
                    for (size_t i = 0; i < per; i++)
                        if (out[r * per + i] != (float)(r * 1000 + (int)(i % 997))) bad++;
            }
        }
    }
    double mean = total / iters, slowest = 0.0;
    MPI_Allreduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&bad, wrong, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    free(in);
    free(out);
    return slowest;
}

int main(int argc, char **argv) {
    size_t minb = 64 << 10, maxb = 64 << 20;
    int factor = 4, iters = 20, warmup = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-b")) minb = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-e")) maxb = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-f")) factor = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-n")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w")) warmup = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "mpi_baseline: unknown flag %s (use -b -e -f -n -w)\n", argv[i]);
            return 2;
        }
    }
    if (factor < 2 || iters < 1 || warmup < 0 || minb < 1 || maxb < minb) {
        fprintf(stderr, "mpi_baseline: need -f >= 2, -n >= 1, -w >= 0, 0 < -b <= -e\n");
        return 2;
    }
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (rank == 0) {
        printf("# mpi_baseline: %d ranks, %d warm-up + %d timed iterations (Open MPI)\n", n, warmup, iters);
        printf("#%11s %5s | %24s | %24s | %24s\n", "", "", "Allgather out-of-place", "Allgather in-place",
               "Reduce_scatter_block sum");
        printf("#%11s %5s | %9s %7s %6s | %9s %7s %6s | %9s %7s %6s\n", "size", "type", "time(us)", "busbw",
               "#wrong", "time(us)", "busbw", "#wrong", "time(us)", "busbw", "#wrong");
    }
    for (size_t bytes = minb; bytes <= maxb; bytes *= (size_t)factor) {
        size_t count = bytes / sizeof(float) / (size_t)n * (size_t)n;
        double t[3];
        long wrong[3];
        for (int op = 0; op < 3; op++) t[op] = run((op_t)op, count, iters, warmup, &wrong[op]);
        if (rank == 0) {
            double b = (double)(count * sizeof(float)), k = (double)(n - 1) / n;
            printf("%12zu %5s", count * sizeof(float), "f32");
            for (int op = 0; op < 3; op++)
                printf(" | %9.2f %7.2f %6ld", t[op] * 1e6, b / t[op] / 1e9 * k, wrong[op]);
            printf("\n");
            fflush(stdout);
        }
    }
    MPI_Finalize();
    return 0;
}
