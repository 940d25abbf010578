/*
 * Plain-function wrappers over libfabric's static inline calls (fi_domain,
 * fi_endpoint, fi_mr_reg, fi_read, fi_writemsg, fi_cq_*, fi_av_*), so that
 * Rust can bind them. Every function returns 0 or a negative fi errno
 * unless noted.
 *
 * The shim does not link libfabric: the inline calls go through the
 * objects' ops tables, and the five exported entry points it needs are
 * handed in by odc_fi_bind_library() after the Rust side dlopen()s
 * libfabric.so.1. A binary built with the feature therefore neither needs
 * the library at run time nor loads it (with the signal handlers some of
 * its provider dependencies install) unless the fabric transport is used.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

static int (*p_getinfo)(uint32_t, const char *, const char *, uint64_t,
                        const struct fi_info *, struct fi_info **);
static void (*p_freeinfo)(struct fi_info *);
static struct fi_info *(*p_dupinfo)(const struct fi_info *);
static int (*p_fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
static const char *(*p_strerror)(int);

/* Installs libfabric's exported entry points (from dlsym). Call once,
 * before anything else here; returns -FI_EINVAL if one is missing. */
int odc_fi_bind_library(void *getinfo, void *freeinfo, void *dupinfo, void *fabric,
                        void *strerror_fn)
{
    if (!getinfo || !freeinfo || !dupinfo || !fabric || !strerror_fn)
        return -FI_EINVAL;
    p_getinfo = (int (*)(uint32_t, const char *, const char *, uint64_t,
                         const struct fi_info *, struct fi_info **))getinfo;
    p_freeinfo = (void (*)(struct fi_info *))freeinfo;
    p_dupinfo = (struct fi_info * (*)(const struct fi_info *))dupinfo;
    p_fabric = (int (*)(struct fi_fabric_attr *, struct fid_fabric **, void *))fabric;
    p_strerror = (const char *(*)(int))strerror_fn;
    return 0;
}

/* A completion, in a layout owned by this shim (mirrored in sys.rs). */
struct odc_cq_entry {
    void *op_context;
    uint64_t flags;
    uint64_t len;
    uint64_t data;
};

/* Flags the Rust side needs, so it never hard-codes libfabric's values. */
uint64_t odc_fi_flag_remote_cq_data(void) { return FI_REMOTE_CQ_DATA; }
uint64_t odc_fi_flag_read(void) { return FI_READ; }
uint64_t odc_fi_flag_write(void) { return FI_WRITE; }
uint64_t odc_fi_mr_bit_local(void) { return FI_MR_LOCAL; }
uint64_t odc_fi_mr_bit_virt_addr(void) { return FI_MR_VIRT_ADDR; }
uint64_t odc_fi_mr_bit_allocated(void) { return FI_MR_ALLOCATED; }
uint64_t odc_fi_mr_bit_prov_key(void) { return FI_MR_PROV_KEY; }
uint64_t odc_fi_mr_bit_endpoint(void) { return FI_MR_ENDPOINT; }
size_t odc_fi_context_size(void) { return sizeof(struct fi_context); }
int odc_fi_eagain(void) { return FI_EAGAIN; }
int odc_fi_eavail(void) { return FI_EAVAIL; }

const char *odc_fi_strerror(int err) { return p_strerror ? p_strerror(err) : "libfabric not loaded"; }

/*
 * fi_getinfo for an RDM endpoint with one-sided RMA, 64-bit remote CQ data
 * and FI_CONTEXT, bound to node:service (FI_SOURCE). mr_mode: the bits we
 * offer to honour.
 */
int odc_fi_getinfo(const char *prov, const char *node, const char *service,
                   uint64_t mr_mode, struct fi_info **out)
{
    struct fi_info *hints;
    int ret;

    if (!p_getinfo)
        return -FI_ENOSYS;
    hints = p_dupinfo(NULL);
    if (!hints)
        return -FI_ENOMEM;
    hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    hints->mode = FI_CONTEXT;
    hints->addr_format = FI_SOCKADDR_IN;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    hints->domain_attr->mr_mode = (int)mr_mode;
    hints->domain_attr->cq_data_size = 4; /* an RDMA immediate; see signal.rs */
    if (prov && *prov)
        hints->fabric_attr->prov_name = strdup(prov);
    ret = p_getinfo(FI_VERSION(1, 17), node, service, FI_SOURCE, hints, out);
    p_freeinfo(hints);
    return ret;
}

void odc_fi_freeinfo(struct fi_info *info) { p_freeinfo(info); }
uint64_t odc_fi_info_mr_mode(const struct fi_info *i) { return (uint64_t)i->domain_attr->mr_mode; }
uint64_t odc_fi_info_cq_data_size(const struct fi_info *i) { return i->domain_attr->cq_data_size; }
uint64_t odc_fi_info_iov_limit(const struct fi_info *i) { return i->tx_attr->iov_limit; }
uint64_t odc_fi_info_max_msg_size(const struct fi_info *i) { return i->ep_attr->max_msg_size; }
uint64_t odc_fi_info_tx_size(const struct fi_info *i) { return i->tx_attr->size; }
const char *odc_fi_info_prov_name(const struct fi_info *i) { return i->fabric_attr->prov_name; }

int odc_fi_fabric(struct fi_info *i, struct fid_fabric **out) { return p_fabric(i->fabric_attr, out, NULL); }
int odc_fi_domain(struct fid_fabric *f, struct fi_info *i, struct fid_domain **out) { return fi_domain(f, i, out, NULL); }

int odc_fi_cq_open(struct fid_domain *d, size_t size, struct fid_cq **out)
{
    struct fi_cq_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.size = size;
    attr.format = FI_CQ_FORMAT_DATA;
    attr.wait_obj = FI_WAIT_UNSPEC;
    return fi_cq_open(d, &attr, out, NULL);
}

int odc_fi_av_open(struct fid_domain *d, struct fid_av **out)
{
    struct fi_av_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.type = FI_AV_TABLE;
    return fi_av_open(d, &attr, out, NULL);
}

int odc_fi_endpoint(struct fid_domain *d, struct fi_info *i, struct fid_ep **out) { return fi_endpoint(d, i, out, NULL); }
int odc_fi_ep_bind_cq(struct fid_ep *ep, struct fid_cq *cq) { return fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV); }
int odc_fi_ep_bind_av(struct fid_ep *ep, struct fid_av *av) { return fi_ep_bind(ep, &av->fid, 0); }
int odc_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int odc_fi_getname(struct fid_ep *ep, void *addr, size_t *len) { return fi_getname(&ep->fid, addr, len); }

/* Returns the number inserted (1) or a negative fi errno. */
int odc_fi_av_insert(struct fid_av *av, const void *addr, uint64_t *fi_addr)
{
    fi_addr_t a = FI_ADDR_NOTAVAIL;
    int ret = fi_av_insert(av, addr, 1, &a, 0, NULL);
    *fi_addr = a;
    return ret;
}

int odc_fi_mr_reg(struct fid_domain *d, void *buf, size_t len, uint64_t access,
                  uint64_t key, struct fid_mr **out)
{
    return fi_mr_reg(d, buf, len, access, 0, key, 0, out, NULL);
}
uint64_t odc_fi_access_remote(void) { return FI_REMOTE_READ | FI_REMOTE_WRITE | FI_READ | FI_WRITE; }
uint64_t odc_fi_access_local(void) { return FI_READ | FI_WRITE; }
int odc_fi_mr_bind_ep(struct fid_mr *mr, struct fid_ep *ep) { return fi_mr_bind(mr, &ep->fid, 0); }
int odc_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
uint64_t odc_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
void *odc_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }

int odc_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, uint64_t src,
                uint64_t addr, uint64_t key, void *ctx)
{
    return (int)fi_read(ep, buf, len, desc, (fi_addr_t)src, addr, key, ctx);
}

/* One write of `count` local buffers to [addr, addr + sum(lens)) carrying
 * 64-bit remote CQ data. count may be 0 (a pure signal). */
int odc_fi_writedata_v(struct fid_ep *ep, void *const *bufs, const size_t *lens,
                       void **descs, size_t count, uint64_t dest, uint64_t addr,
                       uint64_t key, uint64_t data, void *ctx)
{
    struct iovec iov[4];
    struct fi_rma_iov rma;
    struct fi_msg_rma msg;
    size_t i, total = 0;

    if (count > 4)
        return -FI_EINVAL;
    for (i = 0; i < count; i++) {
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = lens[i];
        total += lens[i];
    }
    rma.addr = addr;
    rma.len = total;
    rma.key = key;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.desc = descs;
    msg.iov_count = count;
    msg.addr = (fi_addr_t)dest;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = ctx;
    msg.data = data;
    return (int)fi_writemsg(ep, &msg, FI_REMOTE_CQ_DATA | FI_COMPLETION);
}

static int copy_entries(struct fi_cq_data_entry *raw, ssize_t n, struct odc_cq_entry *out)
{
    ssize_t i;
    for (i = 0; i < n; i++) {
        out[i].op_context = raw[i].op_context;
        out[i].flags = raw[i].flags;
        out[i].len = raw[i].len;
        out[i].data = raw[i].data;
    }
    return (int)n;
}

/* Up to 16 completions: the count, -FI_EAGAIN when none, -FI_EAVAIL when an
 * error entry waits for odc_fi_cq_readerr. timeout_ms < 0 blocks. */
int odc_fi_cq_sread(struct fid_cq *cq, struct odc_cq_entry *out, size_t count, int timeout_ms)
{
    struct fi_cq_data_entry raw[16];
    ssize_t n;
    if (count > 16)
        count = 16;
    n = fi_cq_sread(cq, raw, count, NULL, timeout_ms);
    if (n < 0)
        return (int)n;
    return copy_entries(raw, n, out);
}

int odc_fi_cq_read(struct fid_cq *cq, struct odc_cq_entry *out, size_t count)
{
    struct fi_cq_data_entry raw[16];
    ssize_t n;
    if (count > 16)
        count = 16;
    n = fi_cq_read(cq, raw, count);
    if (n < 0)
        return (int)n;
    return copy_entries(raw, n, out);
}

/* The next error entry: its context, fi errno and the provider's text. */
int odc_fi_cq_readerr(struct fid_cq *cq, void **ctx, int *err, char *msg, size_t msg_len)
{
    struct fi_cq_err_entry e;
    const char *s;
    ssize_t n;
    memset(&e, 0, sizeof(e));
    n = fi_cq_readerr(cq, &e, 0);
    if (n < 0)
        return (int)n;
    *ctx = e.op_context;
    *err = e.err;
    s = fi_cq_strerror(cq, e.prov_errno, e.err_data, NULL, 0);
    if (msg_len) {
        strncpy(msg, s ? s : "", msg_len - 1);
        msg[msg_len - 1] = 0;
    }
    return 0;
}

int odc_fi_cq_signal(struct fid_cq *cq) { return fi_cq_signal(cq); }
int odc_fi_cancel(struct fid_ep *ep, void *ctx) { return (int)fi_cancel(&ep->fid, ctx); }

int odc_fi_close_fabric(struct fid_fabric *x) { return fi_close(&x->fid); }
int odc_fi_close_domain(struct fid_domain *x) { return fi_close(&x->fid); }
int odc_fi_close_cq(struct fid_cq *x) { return fi_close(&x->fid); }
int odc_fi_close_av(struct fid_av *x) { return fi_close(&x->fid); }
int odc_fi_close_ep(struct fid_ep *x) { return fi_close(&x->fid); }
int odc_fi_close_mr(struct fid_mr *x) { return fi_close(&x->fid); }
