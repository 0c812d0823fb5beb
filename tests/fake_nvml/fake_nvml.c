// SPDX-License-Identifier: Apache-2.0
/* fake_nvml.c — A TEST FAKE of NVIDIA's libnvidia-ml.so.1. It drives no GPU and must never be installed.
 *
 * The tests compile it with gcc as libnvidia-ml.so.1 (soname included) so that the REAL Python binding
 * (nvidia-ml-py's pynvml, which does CDLL("libnvidia-ml.so.1")) loads it: either first on LD_LIBRARY_PATH in a
 * subprocess, or preloaded by absolute path in the test process (the dynamic linker then hands pynvml the library
 * already loaded under that soname). Every pynvml struct layout and argument convention is thus exercised for real.
 *
 * Ground truth: a text file named by $FAKE_NVML_STATE, re-read at every call, so a test changes values and injects
 * faults between ticks by rewriting it (write a temp file and rename it: the fake may read at any moment).
 *
 *     driver 550.54.15                      count N            (number of GPUs; default 0)
 *     I uuid GPU-…   I name …   I minor M   I lost 1           (I = GPU index)
 *     I util GPU MEM (%)        I mem TOTAL USED (bytes)       I clocks SM MEM (MHz)   I power MW
 *     I energy MJ (total)       I temp C   I pcie TX RX (KB/s) I throttle MASK         I ecc CORR UNCORR
 *     I persistence 0|1         (persistence mode; default 1)
 *     I remap CORR UNCORR PENDING FAILURE  I nvlink_tx K0 K1 … (KiB per link, totals)  I nvlink_rx …
 *     I nvlink_no_aggregate 1   (refuse scopeId UINT_MAX, as some drivers do: callers must sum the links)
 *     I procs PID:BYTES …       I gprocs PID:BYTES …           (compute / graphics process lists)
 *     I xids X …                (every XID so far; an event set sees those added after it registered)
 *     I gpm 1                   I gpm_values ID=VALUE …        (GPM support; metric values over an interval)
 *     I unsupported nvmlFnName …  (those functions return NVML_ERROR_NOT_SUPPORTED for this GPU)
 *     I missing nvmlFnName …      (those return NVML_ERROR_FUNCTION_NOT_FOUND: a driver older than the call)
 *     I putil PID:TS:SM:MEM:ENC:DEC …   per-process utilization samples (TS in µs); both per-process calls return
 *                                      those newer than the caller's last-seen time stamp (NOT_FOUND when none)
 *     I accounting 0|1          I acct PID:GPU%:MEM%:MAXMEM:TIME_MS:START_US:RUNNING …   (accounting mode, records)
 *     I mig_mode 1              (MIG enabled: device calls other than identity, memory and processes refuse the
 *                                MIG devices' handles, as NVML does)
 *     I mig SLOT UUID GI CI TOTAL USED      a MIG device in slot SLOT (0..6): MIG-UUID, GPU and compute instance
 *     I mig_procs SLOT PID:BYTES …          the compute processes on that MIG device
 *     I mig_gpm SLOT ID=VALUE …             GPM metric values of that MIG device's GPU instance (needs I gpm 1)
 *
 * If $FAKE_NVML_LOG names a file, every device call appends "function index" to it: tests count calls.
 * Left out on purpose (so pynvml raises NVMLError_FunctionNotFound, as with an older driver):
 * nvmlDeviceGetCurrentClocksEventReasons (only the older ...ClocksThrottleReasons is here) and
 * nvmlDeviceGetMPSComputeRunningProcesses_v3.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum { OK = 0, UNINIT = 1, INVALID = 2, NOT_SUPPORTED = 3, NOT_FOUND = 6, INSUFFICIENT = 7, TIMEOUT = 10,
       FUNCTION_NOT_FOUND = 13, LOST = 15, VERSION_MISMATCH = 25 };

#define MAXDEV 8
#define MAXPROC 32
#define MAXXID 64
#define MAXLINK 18
#define MAXGPM 16
#define MAXMIG 7

struct proc { unsigned pid; unsigned long long mem; };
struct mig {
    int present, nprocs;
    char uuid[96];
    unsigned gi, ci;
    unsigned long long mem_total, mem_used;
    struct proc procs[MAXPROC];
    int ngpm;
    unsigned gpm_id[MAXGPM];
    double gpm_val[MAXGPM];
};
struct dev {
    char uuid[96], name[96], unsupported[1024];
    unsigned minor, util_gpu, util_mem, clk_sm, clk_mem, clk_sm_max, power, temp, pcie_tx, pcie_rx, remap[4], nopersist;
    int lost, nlinks, no_aggregate, nprocs, ngprocs, nxids, gpm, ngpm;
    unsigned long long mem_total, mem_used, energy, throttle, ecc[2], nvl_tx[MAXLINK], nvl_rx[MAXLINK];
    unsigned long long xids[MAXXID];
    struct proc procs[MAXPROC], gprocs[MAXPROC];
    unsigned gpm_id[MAXGPM];
    double gpm_val[MAXGPM];
    int mig_mode;
    struct mig migs[MAXMIG];
    char missing[1024];
    int nps, acct_mode, nacct;
    struct { unsigned pid, sm, mem, enc, dec; unsigned long long ts; } ps[MAXPROC];
    struct { unsigned pid, gpu, mem, running; unsigned long long maxmem, time_ms, start_us; } acct[MAXPROC];
};
static struct { int count; char driver[32]; struct dev d[MAXDEV]; } S;
typedef struct handle { int index, mig; } *nvmlDevice_t;   /* mig: the MIG slot, -1 for a whole GPU */
static struct handle handles[MAXDEV] = {{0, -1}, {1, -1}, {2, -1}, {3, -1}, {4, -1}, {5, -1}, {6, -1}, {7, -1}};
static struct handle mig_handles[MAXDEV][MAXMIG];
static int refcount;

int fake_nvml_is_fake(void) { return 1; }   /* lets a test prove that pynvml loaded this file */

static int parse_procs(char *s, struct proc *out) {
    int n = 0;
    for (char *save, *tok = strtok_r(s, " \t", &save); tok && n < MAXPROC; tok = strtok_r(NULL, " \t", &save))
        if (sscanf(tok, "%u:%llu", &out[n].pid, &out[n].mem) == 2)
            n++;
    return n;
}

static int parse_ulls(char *s, unsigned long long *out, int max) {
    int n = 0;
    for (char *save, *tok = strtok_r(s, " \t", &save); tok && n < max; tok = strtok_r(NULL, " \t", &save))
        out[n++] = strtoull(tok, NULL, 0);
    return n;
}

/* Re-read the state file: the test is the GPU, and it changes between calls. */
static void load(void) {
    memset(&S, 0, sizeof S);
    strcpy(S.driver, "999.99.99");
    for (int i = 0; i < MAXDEV; i++) {
        struct dev *d = &S.d[i];
        snprintf(d->uuid, sizeof d->uuid, "GPU-00000000-0000-0000-0000-00000000000%d", i);
        strcpy(d->name, "Fake GPU (test double)");
        d->minor = i;
    }
    const char *path = getenv("FAKE_NVML_STATE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f)
        return;
    char line[4096], key[64];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        int idx, off = 0;
        if (sscanf(line, "count %d", &S.count) == 1 || sscanf(line, "driver %31s", S.driver) == 1)
            continue;
        if (sscanf(line, "%d %63s %n", &idx, key, &off) < 2 || idx < 0 || idx >= MAXDEV)
            continue;
        struct dev *d = &S.d[idx];
        char *v = line + off;
        unsigned long long t[4] = {0};
        if (!strcmp(key, "uuid")) snprintf(d->uuid, sizeof d->uuid, "%s", v);
        else if (!strcmp(key, "name")) snprintf(d->name, sizeof d->name, "%s", v);
        else if (!strcmp(key, "unsupported")) snprintf(d->unsupported, sizeof d->unsupported, " %s ", v);
        else if (!strcmp(key, "minor")) d->minor = atoi(v);
        else if (!strcmp(key, "lost")) d->lost = atoi(v);
        else if (!strcmp(key, "util")) sscanf(v, "%u %u", &d->util_gpu, &d->util_mem);
        else if (!strcmp(key, "mem")) sscanf(v, "%llu %llu", &d->mem_total, &d->mem_used);
        else if (!strcmp(key, "clocks")) sscanf(v, "%u %u", &d->clk_sm, &d->clk_mem);
        else if (!strcmp(key, "max_sm_clock")) sscanf(v, "%u", &d->clk_sm_max);
        else if (!strcmp(key, "power")) d->power = atoi(v);
        else if (!strcmp(key, "energy")) d->energy = strtoull(v, NULL, 0);
        else if (!strcmp(key, "temp")) d->temp = atoi(v);
        else if (!strcmp(key, "persistence")) d->nopersist = !atoi(v);
        else if (!strcmp(key, "pcie")) sscanf(v, "%u %u", &d->pcie_tx, &d->pcie_rx);
        else if (!strcmp(key, "throttle")) d->throttle = strtoull(v, NULL, 0);
        else if (!strcmp(key, "ecc")) sscanf(v, "%llu %llu", &d->ecc[0], &d->ecc[1]);
        else if (!strcmp(key, "remap")) {
            parse_ulls(v, t, 4);
            for (int k = 0; k < 4; k++) d->remap[k] = (unsigned)t[k];
        }
        else if (!strcmp(key, "nvlink_tx")) d->nlinks = parse_ulls(v, d->nvl_tx, MAXLINK);
        else if (!strcmp(key, "nvlink_rx")) parse_ulls(v, d->nvl_rx, MAXLINK);
        else if (!strcmp(key, "nvlink_no_aggregate")) d->no_aggregate = atoi(v);
        else if (!strcmp(key, "procs")) d->nprocs = parse_procs(v, d->procs);
        else if (!strcmp(key, "missing")) snprintf(d->missing, sizeof d->missing, " %s ", v);
        else if (!strcmp(key, "accounting")) d->acct_mode = atoi(v);
        else if (!strcmp(key, "putil") || !strcmp(key, "acct")) {
            int is_ps = key[0] == 'p';
            for (char *save, *tok = strtok_r(v, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
                if (is_ps && d->nps < MAXPROC) {
                    typeof(&d->ps[0]) p = &d->ps[d->nps];
                    if (sscanf(tok, "%u:%llu:%u:%u:%u:%u", &p->pid, &p->ts, &p->sm, &p->mem, &p->enc, &p->dec) == 6)
                        d->nps++;
                } else if (!is_ps && d->nacct < MAXPROC) {
                    typeof(&d->acct[0]) a = &d->acct[d->nacct];
                    if (sscanf(tok, "%u:%u:%u:%llu:%llu:%llu:%u", &a->pid, &a->gpu, &a->mem, &a->maxmem, &a->time_ms,
                               &a->start_us, &a->running) == 7)
                        d->nacct++;
                }
            }
        }
        else if (!strcmp(key, "gprocs")) d->ngprocs = parse_procs(v, d->gprocs);
        else if (!strcmp(key, "xids")) d->nxids = parse_ulls(v, d->xids, MAXXID);
        else if (!strcmp(key, "gpm")) d->gpm = atoi(v);
        else if (!strcmp(key, "mig_mode")) d->mig_mode = atoi(v);
        else if (!strcmp(key, "mig")) {
            unsigned slot;
            struct mig m = {0};
            if (sscanf(v, "%u %95s %u %u %llu %llu", &slot, m.uuid, &m.gi, &m.ci, &m.mem_total, &m.mem_used) == 6
                    && slot < MAXMIG) {
                m.present = 1;
                m.nprocs = d->migs[slot].nprocs;
                memcpy(m.procs, d->migs[slot].procs, sizeof m.procs);
                m.ngpm = d->migs[slot].ngpm;
                memcpy(m.gpm_id, d->migs[slot].gpm_id, sizeof m.gpm_id);
                memcpy(m.gpm_val, d->migs[slot].gpm_val, sizeof m.gpm_val);
                d->migs[slot] = m;
            }
        }
        else if (!strcmp(key, "mig_procs")) {
            unsigned slot;
            int at = 0;
            if (sscanf(v, "%u %n", &slot, &at) >= 1 && slot < MAXMIG)
                d->migs[slot].nprocs = parse_procs(v + at, d->migs[slot].procs);
        }
        else if (!strcmp(key, "mig_gpm")) {
            unsigned slot;
            int at = 0;
            if (sscanf(v, "%u %n", &slot, &at) >= 1 && slot < MAXMIG) {
                struct mig *m = &d->migs[slot];
                char *save;
                m->ngpm = 0;
                for (char *tok = strtok_r(v + at, " \t", &save); tok && m->ngpm < MAXGPM;
                     tok = strtok_r(NULL, " \t", &save))
                    if (sscanf(tok, "%u=%lf", &m->gpm_id[m->ngpm], &m->gpm_val[m->ngpm]) == 2)
                        m->ngpm++;
            }
        }
        else if (!strcmp(key, "gpm_values")) {
            char *save;
            for (char *tok = strtok_r(v, " \t", &save); tok && d->ngpm < MAXGPM; tok = strtok_r(NULL, " \t", &save))
                if (sscanf(tok, "%u=%lf", &d->gpm_id[d->ngpm], &d->gpm_val[d->ngpm]) == 2)
                    d->ngpm++;
        }
    }
    fclose(f);
}

static void log_call(const char *fn, int idx) {
    const char *path = getenv("FAKE_NVML_LOG");
    if (!path)
        return;
    char buf[160];
    int n = snprintf(buf, sizeof buf, "%s %d\n", fn, idx);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        if (write(fd, buf, n) < 0) { /* a test that cannot log sees fewer calls: nothing else to do */ }
        close(fd);
    }
}

static int index_of(nvmlDevice_t h) {
    if (h >= handles && h < handles + MAXDEV)
        return h->index;
    if (h >= &mig_handles[0][0] && h < &mig_handles[0][0] + MAXDEV * MAXMIG)
        return h->index;
    return -1;
}

/* The MIG device a handle names, or NULL for a whole GPU's handle. */
static struct mig *mig_of(nvmlDevice_t h, struct dev *d) {
    return (h >= &mig_handles[0][0] && h < &mig_handles[0][0] + MAXDEV * MAXMIG) ? &d->migs[h->mig] : NULL;
}

/* Every device call: initialized? fresh state, known handle, GPU still on the bus, function supported? A MIG
 * device's handle is refused (as NVML does for most queries) unless the function takes one (`any`). */
static nvmlReturn_t enter_any(const char *fn, nvmlDevice_t h, struct dev **out, int any);
static nvmlReturn_t enter(const char *fn, nvmlDevice_t h, struct dev **out) { return enter_any(fn, h, out, 0); }
static nvmlReturn_t enter_any(const char *fn, nvmlDevice_t h, struct dev **out, int any) {
    if (refcount <= 0)
        return UNINIT;
    load();
    int i = index_of(h);
    log_call(fn, i);
    if (i < 0 || i >= S.count)
        return INVALID;
    struct dev *d = &S.d[i];
    if (d->lost)
        return LOST;
    if (mig_of(h, d) && (!any || !d->mig_mode || !mig_of(h, d)->present))
        return mig_of(h, d)->present && d->mig_mode ? NOT_SUPPORTED : INVALID;
    char pat[128];
    snprintf(pat, sizeof pat, " %s ", fn);
    if (strstr(d->unsupported, pat))
        return NOT_SUPPORTED;
    if (strstr(d->missing, pat))
        return FUNCTION_NOT_FOUND;
    *out = d;
    return OK;
}

#define ENTER(h) struct dev *d; nvmlReturn_t r_ = enter(__func__, h, &d); if (r_ != OK) return r_
#define ENTER_ANY(h) struct dev *d; nvmlReturn_t r_ = enter_any(__func__, h, &d, 1); if (r_ != OK) return r_; \
    struct mig *m = mig_of(h, d)

/* ---- library ---------------------------------------------------------------------------------------------- */
nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; refcount++; return OK; }
nvmlReturn_t nvmlInit_v2(void) { refcount++; return OK; }
nvmlReturn_t nvmlShutdown(void) { if (refcount <= 0) return UNINIT; refcount--; return OK; }

const char *nvmlErrorString(nvmlReturn_t r) {
    static const struct { int code; const char *text; } names[] = {
        {OK, "Success"}, {UNINIT, "Uninitialized"}, {INVALID, "Invalid Argument"}, {NOT_SUPPORTED, "Not Supported"},
        {INSUFFICIENT, "Insufficient Size"}, {TIMEOUT, "Timeout"}, {LOST, "GPU is lost"},
        {VERSION_MISMATCH, "Argument version mismatch"}};
    for (unsigned i = 0; i < sizeof names / sizeof names[0]; i++)
        if (names[i].code == r) return names[i].text;
    return "Unknown Error";
}

static nvmlReturn_t copy_str(char *buf, unsigned len, const char *s) {
    if (strlen(s) + 1 > len)
        return INSUFFICIENT;
    strcpy(buf, s);
    return OK;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *buf, unsigned len) {
    if (refcount <= 0) return UNINIT;
    load(); return copy_str(buf, len, S.driver);
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    if (refcount <= 0) return UNINIT;
    load(); *count = S.count; return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned idx, nvmlDevice_t *out) {
    if (refcount <= 0) return UNINIT;
    load();
    log_call(__func__, idx);
    if (idx >= (unsigned)S.count) return INVALID;
    if (S.d[idx].lost) return LOST;
    *out = &handles[idx];
    return OK;
}

/* ---- identity --------------------------------------------------------------------------------------------- */
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *buf, unsigned n) {
    ENTER_ANY(h); return copy_str(buf, n, m ? m->uuid : d->uuid);
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *buf, unsigned n) { ENTER(h); return copy_str(buf, n, d->name); }
nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned *m) { ENTER(h); *m = d->minor; return OK; }
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned *i) { ENTER(h); *i = index_of(h); return OK; }

/* ---- gauges ----------------------------------------------------------------------------------------------- */
typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u) {
    ENTER(h); u->gpu = d->util_gpu; u->memory = d->util_mem; return OK;
}

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *out) {
    ENTER_ANY(h);
    unsigned long long total = m ? m->mem_total : d->mem_total, used = m ? m->mem_used : d->mem_used;
    out->total = total; out->used = used; out->free = total - used; return OK;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *out) {
    ENTER_ANY(h);
    if (out->version != 0x02000028) return VERSION_MISMATCH;   /* nvmlMemory_v2: sizeof | 2 << 24 */
    unsigned long long total = m ? m->mem_total : d->mem_total, used = m ? m->mem_used : d->mem_used;
    out->total = total; out->used = used; out->reserved = 0; out->free = total - used;
    return OK;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, int type, unsigned *mhz) {
    ENTER(h);
    if (type == 1) *mhz = d->clk_sm;          /* NVML_CLOCK_SM */
    else if (type == 2) *mhz = d->clk_mem;    /* NVML_CLOCK_MEM */
    else return INVALID;
    return OK;
}
nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, int type, unsigned *mhz) {
    ENTER(h);
    if (type != 1) return INVALID;            /* NVML_CLOCK_SM only, in this fake */
    if (d->clk_sm_max == 0) return 3;         /* NVML_ERROR_NOT_SUPPORTED */
    *mhz = d->clk_sm_max;
    return OK;
}
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned *mw) { ENTER(h); *mw = d->power; return OK; }
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t h, unsigned long long *mj) {
    ENTER(h); *mj = d->energy; return OK;
}
/* ---- per-process utilization and accounting ------------------------------------------------------------- */
typedef struct { unsigned pid; unsigned long long timeStamp; unsigned smUtil, memUtil, encUtil, decUtil; }
    nvmlProcessUtilizationSample_t;
typedef struct { unsigned long long timeStamp; unsigned pid, smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil; }
    nvmlProcessUtilizationInfo_v1_t;
typedef struct { unsigned version, processSamplesCount; unsigned long long lastSeenTimeStamp;
                 nvmlProcessUtilizationInfo_v1_t *procUtilArray; } nvmlProcessesUtilizationInfo_t;
#define PROCESSES_UTILIZATION_INFO_V1 0x01000018u

static int newer(struct dev *d, unsigned long long last, int *idx) {
    int n = 0;
    for (int i = 0; i < d->nps; i++)
        if (d->ps[i].ts > last)
            idx[n++] = i;
    return n;
}
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t h, nvmlProcessUtilizationSample_t *out, unsigned *count,
                                             unsigned long long last) {
    ENTER(h);
    int idx[MAXPROC], n = newer(d, last, idx);
    if (!n) return NOT_FOUND;
    if (!out || *count < (unsigned)n) { *count = n; return INSUFFICIENT; }
    for (int i = 0; i < n; i++) {
        typeof(&d->ps[0]) p = &d->ps[idx[i]];
        out[i] = (nvmlProcessUtilizationSample_t){p->pid, p->ts, p->sm, p->mem, p->enc, p->dec};
    }
    *count = n;
    return OK;
}
nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t h, nvmlProcessesUtilizationInfo_t *info) {
    ENTER(h);
    if (info->version != PROCESSES_UTILIZATION_INFO_V1) return VERSION_MISMATCH;
    int idx[MAXPROC], n = newer(d, info->lastSeenTimeStamp, idx);
    if (!n) return NOT_FOUND;
    if (!info->procUtilArray || info->processSamplesCount < (unsigned)n) {
        info->processSamplesCount = n;
        return INSUFFICIENT;
    }
    for (int i = 0; i < n; i++) {
        typeof(&d->ps[0]) p = &d->ps[idx[i]];
        info->procUtilArray[i] = (nvmlProcessUtilizationInfo_v1_t){p->ts, p->pid, p->sm, p->mem, p->enc, p->dec, 0, 0};
    }
    info->processSamplesCount = n;
    return OK;
}
typedef struct { unsigned gpuUtilization, memoryUtilization; unsigned long long maxMemoryUsage, time, startTime;
                 unsigned isRunning, reserved[5]; } nvmlAccountingStats_t;
nvmlReturn_t nvmlDeviceGetAccountingMode(nvmlDevice_t h, int *mode) {
    ENTER(h); *mode = d->acct_mode; return OK;
}
nvmlReturn_t nvmlDeviceGetAccountingBufferSize(nvmlDevice_t h, unsigned *size) {
    ENTER(h); *size = MAXPROC; return OK;
}
nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t h, unsigned *count, unsigned *pids) {
    ENTER(h);
    if (!d->acct_mode) return NOT_SUPPORTED;
    if (*count < (unsigned)d->nacct) { *count = d->nacct; return INSUFFICIENT; }
    for (int i = 0; i < d->nacct; i++)
        pids[i] = d->acct[i].pid;
    *count = d->nacct;
    return OK;
}
nvmlReturn_t nvmlDeviceGetAccountingStats(nvmlDevice_t h, unsigned pid, nvmlAccountingStats_t *st) {
    ENTER(h);
    if (!d->acct_mode) return NOT_SUPPORTED;
    for (int i = 0; i < d->nacct; i++)
        if (d->acct[i].pid == pid) {
            typeof(&d->acct[0]) a = &d->acct[i];
            memset(st, 0, sizeof *st);
            *st = (nvmlAccountingStats_t){a->gpu, a->mem, a->maxmem, a->time_ms, a->start_us, a->running, {0}};
            return OK;
        }
    return NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t h, int *mode) {
    ENTER(h); *mode = !d->nopersist; return OK;
}
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, int sensor, unsigned *c) {
    ENTER(h); if (sensor != 0) return INVALID; *c = d->temp; return OK;
}
nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t h, int counter, unsigned *kbs) {
    ENTER(h);
    if (counter == 0) *kbs = d->pcie_tx; else if (counter == 1) *kbs = d->pcie_rx; else return INVALID;
    return OK;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t h, unsigned long long *mask) {
    ENTER(h); *mask = d->throttle; return OK;
}

/* ---- errors ----------------------------------------------------------------------------------------------- */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, int type, int counter, unsigned long long *n) {
    ENTER(h);
    if (type < 0 || type > 1 || counter != 0) return INVALID;   /* only volatile counts are faked */
    *n = d->ecc[type];
    return OK;
}
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned *corr, unsigned *unc, unsigned *pending,
                                       unsigned *failure) {
    ENTER(h); *corr = d->remap[0]; *unc = d->remap[1]; *pending = d->remap[2]; *failure = d->remap[3]; return OK;
}

/* ---- processes: pynvml asks with count 0 first, then again with room ----------------------------------------- */
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gpuInstanceId, computeInstanceId; }
    nvmlProcessInfo_t;
static nvmlReturn_t procs(const struct proc *p, int n, unsigned *count, nvmlProcessInfo_t *out) {
    if (*count < (unsigned)n || (!out && n)) {
        *count = n;
        return INSUFFICIENT;
    }
    for (int i = 0; i < n; i++) {
        out[i].pid = p[i].pid;
        out[i].usedGpuMemory = p[i].mem;
        out[i].gpuInstanceId = out[i].computeInstanceId = 0xFFFFFFFF;
    }
    *count = n;
    return OK;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned *count, nvmlProcessInfo_t *out) {
    ENTER_ANY(h);
    return m ? procs(m->procs, m->nprocs, count, out) : procs(d->procs, d->nprocs, count, out);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t h, unsigned *count, nvmlProcessInfo_t *out) {
    ENTER(h); return procs(d->gprocs, d->ngprocs, count, out);
}

/* ---- field values: NVLink throughput counters (KiB), scopeId = link, or UINT_MAX for all links; link count --- */
typedef struct {
    unsigned fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType, nvmlReturn;
    union { double d; unsigned ui; unsigned long ul; unsigned long long ull; long long sll; int si; } value;
} nvmlFieldValue_t;
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t h, int n, nvmlFieldValue_t *v) {
    ENTER(h);
    for (int i = 0; i < n; i++) {
        unsigned id = v[i].fieldId, scope = v[i].scopeId;
        const unsigned long long *c = id == 138 ? d->nvl_tx : id == 139 ? d->nvl_rx : NULL;
        v[i].valueType = 3;   /* NVML_VALUE_TYPE_UNSIGNED_LONG_LONG */
        v[i].nvmlReturn = OK;
        if (id == 91) {       /* NVML_FI_DEV_NVLINK_LINK_COUNT */
            v[i].valueType = 1;
            v[i].value.ui = d->nlinks;
        } else if (!c || d->nlinks == 0) {
            v[i].nvmlReturn = NOT_SUPPORTED;
        } else if (scope == 0xFFFFFFFFu && d->no_aggregate) {
            v[i].nvmlReturn = INVALID;
        } else if (scope == 0xFFFFFFFFu) {
            v[i].value.ull = 0;
            for (int k = 0; k < d->nlinks; k++) v[i].value.ull += c[k];
        } else if (scope < (unsigned)d->nlinks) {
            v[i].value.ull = c[scope];
        } else {
            v[i].nvmlReturn = INVALID;
        }
    }
    return OK;
}

/* ---- events: a set sees the XIDs listed after it registered a GPU; the timeout is not waited ---------------- */
typedef struct { nvmlDevice_t device; unsigned long long eventType, eventData; unsigned gpuInstanceId,
                 computeInstanceId; } nvmlEventData_t;
typedef struct eventset { unsigned long long types[MAXDEV]; int cursor[MAXDEV]; } *nvmlEventSet_t;
nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (refcount <= 0) return UNINIT;
    *set = calloc(1, sizeof **set);
    return *set ? OK : 20;
}
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t set) {
    ENTER(h);
    int i = index_of(h);
    set->types[i] |= types;
    set->cursor[i] = d->nxids;
    return OK;
}
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms) {
    (void)timeout_ms;
    if (refcount <= 0) return UNINIT;
    load();
    log_call(__func__, -1);
    for (int i = 0; i < S.count; i++) {
        if (!(set->types[i] & 0x8) || S.d[i].lost || set->cursor[i] >= S.d[i].nxids)
            continue;   /* 0x8: nvmlEventTypeXidCriticalError */
        data->device = &handles[i];
        data->eventType = 0x8;
        data->eventData = S.d[i].xids[set->cursor[i]++];
        data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFF;
        return OK;
    }
    return TIMEOUT;
}
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { free(set); return OK; }

/* ---- GPM: metrics between two samples; the fake's value is the state's at the second sample ------------------ */
typedef struct gpmsample { int dev, ngpm; unsigned long seq; unsigned id[MAXGPM]; double val[MAXGPM]; }
    *nvmlGpmSample_t;
typedef struct { unsigned metricId; int nvmlReturn; double value; struct { char *shortName, *longName, *unit; } info; }
    nvmlGpmMetric_t;
typedef struct { unsigned version, numMetrics; nvmlGpmSample_t sample1, sample2; nvmlGpmMetric_t metrics[]; }
    nvmlGpmMetricsGet_t;
typedef struct { unsigned version, isSupportedDevice; } nvmlGpmSupport_t;
static unsigned long gpm_seq;

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t h, nvmlGpmSupport_t *s) {
    ENTER(h);
    if (s->version != 1) return VERSION_MISMATCH;
    s->isSupportedDevice = d->gpm != 0;
    return OK;
}
nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *s) { *s = calloc(1, sizeof **s); return *s ? OK : 20; }
nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t s) { free(s); return OK; }
nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t h, nvmlGpmSample_t s) {
    ENTER(h);
    if (!d->gpm) return NOT_SUPPORTED;
    s->dev = index_of(h);
    s->seq = ++gpm_seq;
    s->ngpm = d->ngpm;
    memcpy(s->id, d->gpm_id, sizeof s->id);
    memcpy(s->val, d->gpm_val, sizeof s->val);
    return OK;
}
/* A MIG device's GPU instance, named by the whole GPU's handle and the instance id (its samples are that
 * instance's: the sample remembers which, so that metrics of two samples from different instances fail). */
nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t h, unsigned gi, nvmlGpmSample_t s) {
    ENTER(h);
    if (!d->gpm || !d->mig_mode) return NOT_SUPPORTED;
    for (int k = 0; k < MAXMIG; k++) {
        struct mig *m = &d->migs[k];
        if (!m->present || m->gi != gi)
            continue;
        s->dev = index_of(h) * 100 + 1 + k;
        s->seq = ++gpm_seq;
        s->ngpm = m->ngpm;
        memcpy(s->id, m->gpm_id, sizeof s->id);
        memcpy(s->val, m->gpm_val, sizeof s->val);
        return OK;
    }
    return NOT_FOUND;
}
nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m) {
    if (refcount <= 0) return UNINIT;
    log_call(__func__, m->sample2 ? m->sample2->dev : -1);
    if (m->version != 1) return VERSION_MISMATCH;
    /* Real NVML needs two samples of one GPU, the second taken later: check what the caller did. */
    if (!m->sample1 || !m->sample2 || !m->sample1->seq || m->sample1->dev != m->sample2->dev ||
        m->sample2->seq <= m->sample1->seq)
        return INVALID;
    for (unsigned i = 0; i < m->numMetrics; i++) {
        nvmlGpmMetric_t *x = &m->metrics[i];
        x->nvmlReturn = NOT_SUPPORTED;
        for (int k = 0; k < m->sample2->ngpm; k++)
            if (m->sample2->id[k] == x->metricId) {
                x->value = m->sample2->val[k];
                x->nvmlReturn = OK;
            }
    }
    return OK;
}

/* ---- MIG: a GPU in MIG mode lists its MIG devices; their handles answer identity, memory and processes ------- */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned *current, unsigned *pending) {
    ENTER(h); *current = *pending = d->mig_mode != 0; return OK;
}
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t h, unsigned *count) {
    ENTER(h); *count = d->mig_mode ? MAXMIG : 0; return OK;
}
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t h, unsigned slot, nvmlDevice_t *out) {
    ENTER(h);
    if (!d->mig_mode || slot >= MAXMIG) return INVALID;
    if (!d->migs[slot].present) return NOT_FOUND;
    int i = index_of(h);
    mig_handles[i][slot].index = i;
    mig_handles[i][slot].mig = (int)slot;
    *out = &mig_handles[i][slot];
    return OK;
}
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned *id) {
    ENTER_ANY(h); if (!m) return INVALID; *id = m->gi; return OK;
}
nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned *id) {
    ENTER_ANY(h); if (!m) return INVALID; *id = m->ci; return OK;
}
