package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// DB is what the dispatcher needs from PostgreSQL; *pgxpool.Pool satisfies it.
// Every call is one autocommitted statement, so claims are short transactions.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// DispatcherConfig tunes a Dispatcher. Zero fields take their defaults.
type DispatcherConfig struct {
	// BatchSize is the most events one claim takes. Default 500.
	BatchSize int
	// MaxRun is the most consecutive events of one aggregate a claim takes
	// while other aggregates compete for the batch. Default BatchSize/4, so a
	// claim always has room for other aggregates beside a hot one (whose old
	// backlog puts it first in line). When the claim leaves the batch room,
	// a run that reached MaxRun is extended (up to BatchSize): an aggregate
	// draining alone pays one claim and one mark per batch, not per MaxRun
	// events. Every run is also bounded by RunBudget.
	MaxRun int
	// RunBudget is how long publishing one aggregate's run may take: a run
	// goes out one event per call, each after the previous one was
	// acknowledged, so the dispatcher sizes runs to RunBudget divided by the
	// publish latency it measures (at least 1, at most MaxRun). Other
	// aggregates of the batch wait for the longest run before their next
	// events can be claimed. Default 100ms.
	RunBudget time.Duration
	// PublishBatchSize is the most messages per Publisher.Publish call.
	// Default 10, the SNS limit. A call never holds two events of one
	// aggregate (see Publisher).
	PublishBatchSize int
	// PublishConcurrency is how many Publish calls of one batch run at once. Default 16.
	PublishConcurrency int
	// Workers is how many claim-publish-mark loops Drain and Run keep going at
	// once, so batches publish while others are claimed and marked. Default
	// 4; at most two of a dispatcher's statements run at once whatever the
	// number, so more workers add publishing overlap, not database load.
	Workers int
	// PollInterval is the pause between claims when nothing is due. Default
	// 25ms: it bounds commit-to-publish latency (see make bench), and an idle
	// claim reads an empty index.
	PollInterval time.Duration
	// MaxWakeups is how many producer wake-ups one claim consumes at most.
	// Default 4 x BatchSize.
	MaxWakeups int
	// RetryFor is how long an event keeps retrying retryable publish
	// failures (throttling, 5xx, network, an SNS, KMS or VPC endpoint outage)
	// before it goes dead and parks its aggregate. Default 24h: an outage
	// shorter than that parks nothing; the RetryingAggregates gauge alarms
	// while it lasts. Permanent failures go dead at once.
	RetryFor time.Duration
	// MaxAttempts optionally also caps publish attempts per event (0, the
	// default: no cap, RetryFor decides).
	MaxAttempts int
	// BackoffBase and BackoffCap shape the retry delay: uniform in
	// [0, min(BackoffCap, BackoffBase*2^(attempt-1))] ("full jitter").
	// Defaults 1s and 5m.
	BackoffBase time.Duration
	BackoffCap  time.Duration
	// Lease is how long a claim stays with its dispatcher unless renewed:
	// the runs of a dispatcher that crashed or lost its database are claimed
	// again this long after its last renewal. A live dispatcher renews its
	// batch's lease every (Lease - 1s - MarkTimeout)/2 while the batch
	// publishes and records its outcomes, so a batch may take longer than
	// Lease; if renewals fail, the batch stops publishing in time to record
	// its outcomes inside the lease it holds. Default 8s: a crashed
	// dispatcher's aggregates wait at most that long.
	Lease time.Duration
	// PublishTimeout bounds one Publish call (and a claim). Default 20s.
	PublishTimeout time.Duration
	// MarkTimeout bounds one statement recording a batch's outcomes (and
	// one lease renewal). A mark that fails or times out is retried at once
	// with a fresh MarkTimeout and, failing that, the batch's runs are
	// released (claimable again at once, published again) rather than left
	// to the lease. A batch stops publishing MarkTimeout before its lease
	// ends (if it cannot renew it) or before the context's deadline.
	// Default 2s.
	MarkTimeout time.Duration
	// DeadlineMargin: Drain and Run start no claim when the context deadline is
	// closer than this, so an invocation ends with nothing half-done. It must
	// exceed MarkTimeout. Default 3s.
	DeadlineMargin time.Duration
	// LogAggregateIDs adds aggregate ids to log lines. Off by default:
	// aggregate ids may carry personal data (FIFOBOX_LOG_AGGREGATE_IDS).
	LogAggregateIDs bool
	// Logger receives structured logs (never payloads). Default slog.Default().
	Logger *slog.Logger
	// OnBatch, if set, is called after each non-empty batch (for metrics).
	OnBatch func(BatchResult)
}

func (c *DispatcherConfig) setDefaults() {
	def := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	defd := func(p *time.Duration, v time.Duration) {
		if *p == 0 {
			*p = v
		}
	}
	def(&c.BatchSize, 500)
	def(&c.MaxRun, max(c.BatchSize/4, 1))
	def(&c.PublishBatchSize, 10)
	def(&c.PublishConcurrency, 16)
	def(&c.Workers, 4)
	def(&c.MaxWakeups, 4*c.BatchSize)
	defd(&c.RunBudget, 100*time.Millisecond)
	defd(&c.PollInterval, 25*time.Millisecond)
	defd(&c.RetryFor, 24*time.Hour)
	defd(&c.BackoffBase, time.Second)
	defd(&c.BackoffCap, 5*time.Minute)
	defd(&c.Lease, 8*time.Second)
	defd(&c.PublishTimeout, 20*time.Second)
	defd(&c.MarkTimeout, 2*time.Second)
	defd(&c.DeadlineMargin, 3*time.Second)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports the first invalid field, and knobs whose relationship
// would let a batch outlive its lease or an invocation's deadline.
func (c DispatcherConfig) Validate() error {
	switch {
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("BatchSize %d: must be 1-10000", c.BatchSize)
	case c.MaxRun < 1 || c.MaxRun > c.BatchSize:
		return fmt.Errorf("MaxRun %d: must be 1-BatchSize (%d)", c.MaxRun, c.BatchSize)
	case c.RunBudget <= 0:
		return fmt.Errorf("RunBudget %s: must be positive", c.RunBudget)
	case c.PublishBatchSize < 1 || c.PublishBatchSize > 10:
		return fmt.Errorf("PublishBatchSize %d: must be 1-10 (the SNS PublishBatch limit)", c.PublishBatchSize)
	case c.PublishConcurrency < 1:
		return fmt.Errorf("PublishConcurrency %d: must be at least 1", c.PublishConcurrency)
	case c.Workers < 1:
		return fmt.Errorf("Workers %d: must be at least 1", c.Workers)
	case c.MaxWakeups < 1:
		return fmt.Errorf("MaxWakeups %d: must be at least 1", c.MaxWakeups)
	case c.MaxAttempts < 0:
		return fmt.Errorf("MaxAttempts %d: must not be negative (0: no cap)", c.MaxAttempts)
	case c.PollInterval <= 0:
		return fmt.Errorf("PollInterval %s: must be positive", c.PollInterval)
	case c.BackoffBase <= 0 || c.BackoffCap < c.BackoffBase:
		return fmt.Errorf("BackoffBase %s, BackoffCap %s: need 0 < base <= cap", c.BackoffBase, c.BackoffCap)
	case c.RetryFor < c.BackoffCap:
		return fmt.Errorf("RetryFor %s: must be at least BackoffCap %s (or an outage parks aggregates after one backoff)", c.RetryFor, c.BackoffCap)
	case c.Lease < time.Second:
		return fmt.Errorf("Lease %s: must be at least 1s", c.Lease)
	case c.PublishTimeout <= 0 || c.MarkTimeout <= 0:
		return fmt.Errorf("PublishTimeout %s, MarkTimeout %s: must be positive", c.PublishTimeout, c.MarkTimeout)
	case c.MarkTimeout+time.Second >= c.Lease:
		// PublishTimeout is not bounded by the lease: the lease is renewed
		// while a batch publishes. It must leave room to renew it.
		return fmt.Errorf("Lease %s: must exceed MarkTimeout %s + 1s, so a batch can renew its lease and record its outcomes inside it",
			c.Lease, c.MarkTimeout)
	case c.DeadlineMargin <= c.MarkTimeout:
		return fmt.Errorf("DeadlineMargin %s: must exceed MarkTimeout %s, so the last batch before a deadline has time to publish", c.DeadlineMargin, c.MarkTimeout)
	}
	return nil
}

// BackoffCeiling is the largest retry delay after the given attempt (1-based):
// min(BackoffCap, BackoffBase*2^(attempt-1)).
func (c DispatcherConfig) BackoffCeiling(attempt int) time.Duration {
	if attempt < 1 {
		attempt = 1
	}
	d := c.BackoffBase
	for i := 1; i < attempt; i++ {
		d *= 2
		if d >= c.BackoffCap || d <= 0 {
			return c.BackoffCap
		}
	}
	if d > c.BackoffCap {
		return c.BackoffCap
	}
	return d
}

// BatchResult describes one claim-publish-mark cycle.
type BatchResult struct {
	// Claimed counts events claimed, in Runs runs (one per aggregate).
	Claimed int
	Runs    int
	// Sent, Retried and Dead count events by outcome. Released counts events
	// claimed but not published because their run stopped first (the batch's
	// time limit, or an earlier event of the run failed): they stay pending,
	// unattempted.
	Sent     int
	Retried  int
	Dead     int
	Released int
	// Lost counts runs whose lease expired before their outcome was recorded;
	// another dispatcher owns them now.
	Lost int
	// PublishDuration is the wall time of the publish step.
	PublishDuration time.Duration
}

// Totals are a dispatcher's cumulative counts since it was created.
type Totals struct {
	Claimed, Sent, Retried, Dead, Released, Lost int64
}

// Dispatcher moves events from the outbox to a Publisher, preserving
// per-aggregate order.
//
// Ordering design: each aggregate has a head (outbox_heads, maintained by
// the dispatcher; migrations/00009_outbox_heads.sql): the lowest unsent
// sequence and when it is due. A claim takes due heads, oldest first, FOR
// UPDATE SKIP LOCKED, and leases each with a run of its consecutive pending
// events; while leased, no other claim takes the aggregate. A run is
// published one event per Publish call, each only after the previous one was
// acknowledged (a wave of calls per position in the runs, each call holding
// one event of up to PublishBatchSize aggregates): SNS documents that a
// PublishBatch publishes a FIFO group's entries in order and reports each
// entry separately, but not what becomes of later entries of a group when
// one fails, so two events of one group never share a call. At the first
// failure the rest of the run stays pending behind it; a retrying or dead
// head holds back only its own aggregate, and costs a claim nothing (it is
// not due). Any number of dispatchers may run (overlapping Lambda
// invocations); no session state is used (RDS Proxy friendly).
type Dispatcher struct {
	db  DB
	pub Publisher
	cfg DispatcherConfig
	log *slog.Logger

	mu        sync.Mutex
	rnd       *rand.Rand
	latency   time.Duration // moving average of one Publish call
	claimTook time.Duration // recent claim statements' duration (see claimLease)

	// dbSlots bounds this dispatcher's concurrent statements (claims and
	// marks) to two: more batches may be publishing at once (Workers), but
	// more statements at once only contend for the database's CPU.
	dbSlots chan struct{}

	claimed, sent, retried, dead, released, lost atomic.Int64
	// succeeded counts RunOnce calls that returned no error: Run's retry
	// backoff starts over once one does.
	succeeded atomic.Int64
	// failedAt is succeeded's count when Drain's first error happened.
	failedAt atomic.Int64
	// truncatedAt is when this dispatcher last asked to truncate a drained
	// wake-up slot (UnixNano; see truncateWakeups).
	truncatedAt atomic.Int64
}

// NewDispatcher returns a Dispatcher reading from db and publishing with pub.
func NewDispatcher(db DB, pub Publisher, cfg DispatcherConfig) (*Dispatcher, error) {
	if db == nil {
		return nil, errors.New("new dispatcher: db is nil")
	}
	if pub == nil {
		return nil, errors.New("new dispatcher: publisher is nil")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new dispatcher: config: %w", err)
	}
	return &Dispatcher{
		db: db, pub: pub, cfg: cfg, log: cfg.Logger,
		rnd:     rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
		latency: initialPublishLatency,
		dbSlots: make(chan struct{}, 2),
	}, nil
}

// initialPublishLatency is assumed until a Publish call has been timed: runs
// start short (RunBudget / 10ms) and grow if the broker is faster.
const initialPublishLatency = 10 * time.Millisecond

// Config returns the effective configuration (defaults applied).
func (d *Dispatcher) Config() DispatcherConfig { return d.cfg }

// Totals returns cumulative counts.
func (d *Dispatcher) Totals() Totals {
	return Totals{Claimed: d.claimed.Load(), Sent: d.sent.Load(), Retried: d.retried.Load(), Dead: d.dead.Load(),
		Released: d.released.Load(), Lost: d.lost.Load()}
}

// run is one aggregate's claimed events, published in order.
type run struct {
	msgs  []Message
	typ   string
	id    string
	wakes int64
	// retrying is how long the head event has been failing (retryably) at
	// claim time; negative if it is not retrying.
	retrying time.Duration
	// done counts messages acknowledged; err is msgs[done]'s failure.
	done int
	err  error
	// ended: the claim (or the last extension) read fewer events than it
	// asked for, so it saw nothing unsent after the run. The mark's hint for
	// idling the head (migrations/00065); the mark checks again before the
	// head stays idle.
	ended bool
}

// emptyHead is a head a claim found with nothing to publish.
type emptyHead struct {
	typ, id string
	wakes   int64
}

// RunOnce claims one batch, publishes it and records every outcome. Once a
// batch is claimed it is finished even if ctx is cancelled (publishing and
// marking use their own time limits, inside ctx's deadline), so a stop never
// leaves rows half-done. While the batch is in hand its lease is renewed; a
// crash leaves its runs leased until the last renewal's lease ends (Lease),
// and they are claimed again then.
func (d *Dispatcher) RunOnce(ctx context.Context) (BatchResult, error) {
	if err := ctx.Err(); err != nil {
		return BatchResult{}, err
	}
	token := uuid.New()
	claimedAt := time.Now()
	lease := d.claimLease()
	runs, empties, err := d.claim(ctx, token, lease)
	if err != nil {
		return BatchResult{}, err
	}
	d.truncateWakeups(ctx)
	if len(runs) == 0 {
		if len(empties) > 0 {
			d.idle(ctx, empties)
		}
		return BatchResult{}, nil
	}
	keeper := d.keepLease(ctx, token, runs, claimedAt.Add(lease))
	defer keeper.stop()
	d.extend(ctx, token, runs)
	if len(empties) > 0 {
		// After the batch is published: retiring empty heads is
		// bookkeeping, and its statement slot may be behind a slow claim.
		defer d.idle(ctx, empties)
	}
	res := BatchResult{Runs: len(runs)}
	for _, r := range runs {
		res.Claimed += len(r.msgs)
	}
	d.claimed.Add(int64(res.Claimed))

	start := time.Now()
	d.publishRuns(keeper.publishing, runs, d.publishDeadline(ctx))
	res.PublishDuration = time.Since(start)

	m := markArgs{token: token}
	for _, r := range runs {
		m.add(d, r, claimedAt, &res)
	}
	marked, retried, err := d.record(context.WithoutCancel(ctx), m, keeper)
	if err != nil {
		return res, err
	}
	if !retried {
		// After a retried mark the count is not a loss: the first attempt
		// may have recorded some runs before it timed out.
		res.Lost = len(runs) - int(marked)
	}
	if res.Lost > 0 {
		d.log.Warn("outbox claim lease expired before outcomes were recorded", "runs", res.Lost, "lease", d.cfg.Lease.String())
	}
	d.sent.Add(int64(res.Sent))
	d.retried.Add(int64(res.Retried))
	d.dead.Add(int64(res.Dead))
	d.released.Add(int64(res.Released))
	d.lost.Add(int64(res.Lost))
	if d.cfg.OnBatch != nil {
		d.cfg.OnBatch(res)
	}
	return res, nil
}

// publishDeadline is when a batch stops starting Publish calls because of
// ctx's deadline: MarkTimeout before it (a Lambda invocation is killed at
// its deadline, and the outcomes are to be recorded before). Zero if ctx has
// no deadline. (The lease bounds a batch only when it cannot be renewed: see
// leaseKeeper.)
func (d *Dispatcher) publishDeadline(ctx context.Context) time.Time {
	dl, ok := ctx.Deadline()
	if !ok {
		return time.Time{}
	}
	return dl.Add(-returnMargin - d.cfg.MarkTimeout)
}

// statementDeadline bounds one statement recording or renewing a batch:
// MarkTimeout from now, and never past ctx's deadline.
func (d *Dispatcher) statementDeadline(ctx context.Context) time.Time {
	end := time.Now().Add(d.cfg.MarkTimeout)
	if dl, ok := ctx.Deadline(); ok {
		end = minTime(end, dl.Add(-returnMargin))
	}
	return end
}

// leaseMargin is how long before its lease ends a batch that could not renew
// it stops publishing: MarkTimeout to record the outcomes, and a second for
// clock drift between this process and PostgreSQL (the lease's end is
// PostgreSQL's now() plus Lease).
func (d *Dispatcher) leaseMargin() time.Duration { return time.Second + d.cfg.MarkTimeout }

// renewEvery is the interval between lease renewals: two chances to renew
// before a batch would have to stop publishing.
func (d *Dispatcher) renewEvery() time.Duration { return (d.cfg.Lease - d.leaseMargin()) / 2 }

// errLeaseEnding cancels a batch's publishing when its lease could not be
// renewed and ends within leaseMargin.
var errLeaseEnding = errors.New("outbox: claim lease could not be renewed; batch stops publishing")

// leaseKeeper renews one batch's lease (outbox_extend_lease) from claim
// until its outcomes are recorded, so runs of a live dispatcher stay its own
// however long publishing takes, while a dispatcher that crashed or lost its
// database loses them Lease after its last renewal. If renewals fail, it
// cancels publishing (the publishing context) leaseMargin before the lease
// it holds ends, so the outcomes can still be recorded inside it.
//
// Renewals do not wait for the dispatcher's two statement slots (dbSlots):
// they are rare (none for a batch shorter than renewEvery), a primary-key
// update per run, and must not queue behind the claims they keep valid.
type leaseKeeper struct {
	d          *Dispatcher
	ctx        context.Context // for its deadline; never cancelled
	token      uuid.UUID
	types, ids []string
	publishing context.Context
	cancel     context.CancelCauseFunc
	quit, done chan struct{}
	recording  atomic.Bool // the batch's outcomes are being recorded
}

// claimLease is the lease a claim asks for: Lease, plus twice what claims
// have been taking (at most PublishTimeout). The lease starts when the claim
// statement does, so a claim slowed down (a long transaction elsewhere keeps
// dead row versions in its way) would otherwise hand back runs whose lease
// is nearly over, for another claim to take again; and a crash right after
// a claim costs a wait of Lease only when claims are fast.
func (d *Dispatcher) claimLease() time.Duration {
	d.mu.Lock()
	took := d.claimTook
	d.mu.Unlock()
	return d.cfg.Lease + min(2*took, d.cfg.PublishTimeout)
}

func (d *Dispatcher) observeClaim(took time.Duration) {
	d.mu.Lock()
	d.claimTook = max(took, (3*d.claimTook+took)/4) // rises at once, decays slowly
	d.mu.Unlock()
}

func (d *Dispatcher) keepLease(ctx context.Context, token uuid.UUID, runs []*run, leaseEnd time.Time) *leaseKeeper {
	k := &leaseKeeper{d: d, ctx: context.WithoutCancel(ctx), token: token,
		types: make([]string, len(runs)), ids: make([]string, len(runs)),
		quit: make(chan struct{}), done: make(chan struct{})}
	for i, r := range runs {
		k.types[i], k.ids[i] = r.typ, r.id
	}
	k.publishing, k.cancel = context.WithCancelCause(k.ctx)
	go k.loop(leaseEnd)
	return k
}

// stop ends renewals; the lease then runs its course (the batch's outcomes
// are recorded, or its runs released, by then).
func (k *leaseKeeper) stop() {
	select {
	case <-k.quit:
	default:
		close(k.quit)
	}
	<-k.done
	k.cancel(nil)
}

func (k *leaseKeeper) loop(end time.Time) { // end: the lease held, as this process' clock sees it
	defer close(k.done)
	d := k.d
	next := end.Add(-d.cfg.Lease + d.renewEvery())
	t := time.NewTimer(time.Until(next))
	defer t.Stop()
	warned := false
	for {
		select {
		case <-k.quit:
			return
		case <-t.C:
		}
		if !time.Now().Before(next) {
			start := time.Now()
			n, err := k.renew()
			switch {
			case err != nil:
				d.log.Warn("outbox: renewing a batch's lease failed; will retry", "runs", len(k.ids), "error", err.Error())
			default:
				end = start.Add(d.cfg.Lease)
				// Once the outcomes are being recorded, a head the mark
				// released is no loss.
				if int(n) < len(k.ids) && !warned && !k.recording.Load() {
					warned = true
					d.log.Warn("outbox: some runs' lease had expired and was claimed again", "runs", len(k.ids)-int(n))
				}
			}
			next = time.Now().Add(d.renewEvery())
		}
		cut := end.Add(-d.leaseMargin())
		if !time.Now().Before(cut) && k.publishing.Err() == nil {
			d.log.Warn("outbox: batch lease ending unrenewed; publishing stops", "runs", len(k.ids))
			k.cancel(errLeaseEnding)
		}
		wake := next
		if k.publishing.Err() == nil {
			wake = minTime(wake, cut)
		}
		t.Reset(max(time.Until(wake), time.Millisecond))
	}
}

func (k *leaseKeeper) renew() (int64, error) {
	end := k.d.statementDeadline(k.ctx)
	if !time.Now().Before(end) {
		return 0, errors.New("no time left before the deadline")
	}
	rctx, cancel := context.WithDeadline(k.ctx, end)
	defer cancel()
	var n int64
	if err := k.d.db.QueryRow(rctx, sqlExtendLease, k.token, k.types, k.ids, k.d.cfg.Lease.Milliseconds()).Scan(&n); err != nil {
		return 0, fmt.Errorf("renew lease: %w", err)
	}
	return n, nil
}

// returnMargin is kept before a context's deadline to return a Lambda
// invocation's response.
const returnMargin = 200 * time.Millisecond

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// Drain runs batches with Workers loops until nothing is due (the backlog is
// empty or everything left is waiting for backoff or parked), ctx is done, or
// ctx's deadline is closer than DeadlineMargin. It returns the first error.
//
// A claim that comes back short or empty does not mean the backlog is
// drained: the next events of every aggregate in flight become claimable
// only once the batch holding them is marked. So Drain stops only when a
// claim finds nothing while no other worker has a batch in flight.
func (d *Dispatcher) Drain(ctx context.Context) error {
	stopAt, hasDeadline := d.stopAt(ctx)
	var (
		wg       sync.WaitGroup
		firstErr error
		errOnce  sync.Once
		mu       sync.Mutex
		cond     = sync.NewCond(&mu)
		empty    bool
		busy     int   // workers inside RunOnce
		finished int64 // batches that claimed something and are done
	)
	stop := func() {
		mu.Lock()
		empty = true
		mu.Unlock()
		cond.Broadcast()
	}
	for w := 0; w < d.cfg.Workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && (!hasDeadline || time.Now().Before(stopAt)) {
				mu.Lock()
				if empty {
					mu.Unlock()
					return
				}
				gen := finished
				busy++
				mu.Unlock()

				res, err := d.RunOnce(ctx)
				if err == nil {
					d.succeeded.Add(1)
				}

				mu.Lock()
				busy--
				if res.Claimed > 0 {
					finished++
				}
				if err == nil && res.Claimed == 0 {
					// Nothing claimable now. If another batch is in flight,
					// wait for it: it frees its aggregates' next events.
					// Empty when nothing was in flight or finished since our
					// claim began.
					for busy > 0 && finished == gen && !empty {
						cond.Wait()
					}
					if busy == 0 && finished == gen {
						empty = true
					}
				}
				mu.Unlock()
				cond.Broadcast()
				if err != nil {
					if ctx.Err() == nil {
						errOnce.Do(func() { firstErr = err; d.failedAt.Store(d.succeeded.Load()) })
					}
					stop()
					return
				}
			}
		}()
	}
	wg.Wait()
	return firstErr
}

// Run polls until ctx is done or its deadline is closer than DeadlineMargin:
// it drains, sleeps PollInterval, and drains again. Errors (database or
// broker down) are logged and retried with backoff, which starts over once
// a batch succeeds (a claim that found nothing due, or a batch claimed and
// recorded): a database that comes back between failures (connections
// killed now and then) is not waited for as if it had been down all along.
// Run returns nil when it stops. This is what the scheduled Lambda calls.
func (d *Dispatcher) Run(ctx context.Context) error {
	stopAt, hasDeadline := d.stopAt(ctx)
	failures := 0
	// succeeded's count when the last failure happened: a batch that
	// succeeded since then, in that Drain after the failure or in this
	// one, starts the backoff over.
	atFailure := int64(-1)
	for {
		err := d.Drain(ctx)
		wait := d.cfg.PollInterval
		if err != nil {
			if d.succeeded.Load() != atFailure {
				failures = 0
			}
			atFailure = d.failedAt.Load()
			failures++
			wait = min(d.cfg.PollInterval<<min(failures, 8), 5*time.Second)
			d.log.Warn("outbox dispatch failed; will retry", "error", err.Error(), "retry_in", wait.String())
		} else {
			failures = 0
		}
		if hasDeadline && time.Until(stopAt) < wait {
			return nil
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

func (d *Dispatcher) stopAt(ctx context.Context) (time.Time, bool) {
	dl, ok := ctx.Deadline()
	if !ok {
		return time.Time{}, false
	}
	return dl.Add(-d.cfg.DeadlineMargin), true
}

// runLimit is the longest run the next claim takes: MaxRun, or less if
// that is more than can be published in RunBudget.
func (d *Dispatcher) runLimit() int { return min(d.runBudgetLimit(), d.cfg.MaxRun) }

// runBudgetLimit is the longest run one batch may carry: what can be
// published in RunBudget at the measured latency of one Publish call, at
// most BatchSize.
func (d *Dispatcher) runBudgetLimit() int {
	d.mu.Lock()
	lat := d.latency
	d.mu.Unlock()
	n := d.cfg.BatchSize
	if lat > 0 {
		n = int(min(int64(d.cfg.RunBudget/lat), int64(d.cfg.BatchSize)))
	}
	return max(n, 1)
}

// maxExtensions bounds the extension statements per batch: each is a round
// trip, worth it only for the few runs that hold most of a skewed batch.
const maxExtensions = 4

// extend lengthens runs that reached the claim's run limit while the batch
// has room left (outbox_extend_run): an aggregate with a deep backlog and
// no competitors fills the batch instead of taking MaxRun events per claim
// and mark. Oldest runs first, as claimed. Optional: on failure the batch
// goes out as claimed.
func (d *Dispatcher) extend(ctx context.Context, token uuid.UUID, runs []*run) {
	room := d.cfg.BatchSize
	for _, r := range runs {
		room -= len(r.msgs)
	}
	limit, budget := d.runLimit(), d.runBudgetLimit()
	if room <= 0 || budget <= limit {
		return
	}
	n := 0
	for _, r := range runs {
		if room <= 0 || n == maxExtensions {
			return
		}
		if len(r.msgs) != limit {
			continue // the run ended on its own: nothing consecutive is pending
		}
		n++
		more, err := d.extendRun(ctx, token, r, min(budget-len(r.msgs), room))
		if err != nil {
			d.log.Warn("outbox: extend run failed; publishing the batch as claimed", "error", err.Error())
			return
		}
		room -= more
	}
}

func (d *Dispatcher) extendRun(ctx context.Context, token uuid.UUID, r *run, most int) (int, error) {
	select {
	case d.dbSlots <- struct{}{}:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	defer func() { <-d.dbSlots }()
	end := time.Now().Add(d.cfg.MarkTimeout)
	if dl, ok := ctx.Deadline(); ok {
		end = minTime(end, dl.Add(-returnMargin))
	}
	ectx, cancel := context.WithDeadline(context.WithoutCancel(ctx), end)
	defer cancel()
	last := r.msgs[len(r.msgs)-1]
	rows, err := d.db.Query(ectx, sqlExtendRun, r.typ, r.id, last.Sequence, most, token)
	if err != nil {
		return 0, fmt.Errorf("extend run: %w", err)
	}
	defer rows.Close()
	var more []Message
	for rows.Next() {
		var (
			id, seq                              int64
			eventID, eventType, tenant, traceprt string
			attempts                             int32
			body                                 []byte
		)
		if err := rows.Scan(&id, &eventID, &seq, &eventType, &tenant, &traceprt, &attempts, &body); err != nil {
			return 0, fmt.Errorf("extend run: scan: %w", err)
		}
		m := Message{ID: id, EventID: eventID, GroupID: r.id, AggregateType: r.typ,
			Sequence: seq, EventType: eventType, Body: body, Attempt: int(attempts) + 1}
		m.Attributes = attributes(m.EventType, m.AggregateType, tenant, traceprt)
		more = append(more, m)
	}
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("extend run: %w", err)
	}
	// All or nothing: a run is only ever published from its first event on,
	// in sequence order, so appending is safe only for the rows in full.
	r.msgs = append(r.msgs, more...)
	r.ended = len(more) < most
	return len(more), nil
}

func (d *Dispatcher) observeLatency(took time.Duration) {
	d.mu.Lock()
	d.latency = (4*d.latency + took) / 5
	d.mu.Unlock()
}

// claim takes the next batch: runs in claim order, and heads that turned out
// to have nothing to publish.
func (d *Dispatcher) claim(ctx context.Context, token uuid.UUID, lease time.Duration) ([]*run, []emptyHead, error) {
	select {
	case d.dbSlots <- struct{}{}:
	case <-ctx.Done(): // nothing claimed yet: stopping now leaves nothing half-done
		return nil, nil, ctx.Err()
	}
	defer func() { <-d.dbSlots }()
	// The claim gets its own time limit rather than the caller's
	// cancellation (a cancelled statement would need a CancelRequest, which
	// RDS Proxy lacks), within the invocation's deadline. If it runs out
	// after PostgreSQL committed the claim, the runs come back after their
	// lease.
	end := time.Now().Add(d.cfg.PublishTimeout)
	if dl, ok := ctx.Deadline(); ok {
		end = minTime(end, dl.Add(-returnMargin))
	}
	cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), end)
	defer cancel()
	start := time.Now()
	limit := d.runLimit()
	rows, err := d.db.Query(cctx, sqlClaim, d.cfg.BatchSize, limit, token, lease.Milliseconds(), d.cfg.MaxWakeups)
	if err != nil {
		return nil, nil, fmt.Errorf("claim batch: %w", err)
	}
	defer func() {
		rows.Close()
		d.observeClaim(time.Since(start))
	}()
	var (
		runs    []*run
		empties []emptyHead
		cur     *run
		// The claim returns rows in claim order with each run's events in
		// sequence order, but says so by its plan's structure, not with an
		// ORDER BY (a sort of the whole batch, bodies included, cost
		// PostgreSQL 4 % of its CPU: migrations/00065). The runs are put
		// together here whatever the rows' order: by aggregate, then sorted
		// by sequence below.
		byHead = map[headKey]*run{}
	)
	for rows.Next() {
		var (
			kind, aggType, aggID string
			id, seq, retryingMs  *int64
			eventID, eventType   *string
			tenant, traceparent  string
			attempts             *int32
			body                 []byte
			wakes                int64
		)
		if err := rows.Scan(&kind, &id, &eventID, &aggType, &aggID, &seq, &eventType, &tenant, &traceparent,
			&attempts, &body, &wakes, &retryingMs); err != nil {
			return nil, nil, fmt.Errorf("claim batch: scan: %w", err)
		}
		switch kind {
		case "empty":
			empties = append(empties, emptyHead{typ: aggType, id: aggID, wakes: wakes})
			continue
		case "dead":
			d.log.Warn("outbox head parked: its lowest unsent event is dead", "event_id", deref(eventID),
				"aggregate_type", aggType, "sequence", deref(seq), d.aggID(aggID))
			continue
		}
		if cur == nil || cur.typ != aggType || cur.id != aggID {
			k := headKey{aggType, aggID}
			if cur = byHead[k]; cur == nil {
				cur = &run{typ: aggType, id: aggID, wakes: wakes, retrying: -1}
				if retryingMs != nil {
					cur.retrying = time.Duration(*retryingMs) * time.Millisecond
				}
				byHead[k] = cur
				runs = append(runs, cur)
			}
		}
		m := Message{ID: *id, EventID: *eventID, GroupID: aggID, AggregateType: aggType,
			Sequence: *seq, EventType: *eventType, Body: body, Attempt: int(*attempts) + 1}
		m.Attributes = attributes(m.EventType, m.AggregateType, tenant, traceparent)
		cur.msgs = append(cur.msgs, m)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("claim batch: %w", err)
	}
	for _, r := range runs {
		slices.SortFunc(r.msgs, func(a, b Message) int { return cmp.Compare(a.Sequence, b.Sequence) })
		r.ended = len(r.msgs) < limit
	}
	return runs, empties, nil
}

// headKey names an aggregate's head.
type headKey struct{ typ, id string }

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// aggID is the log attribute for an aggregate id: the id itself only when
// LogAggregateIDs is set.
func (d *Dispatcher) aggID(id string) slog.Attr {
	if !d.cfg.LogAggregateIDs {
		return slog.Attr{}
	}
	return slog.String("aggregate_id", id)
}

// truncateWakeups asks, at most ten times a second, for the wake-up slot that
// producers left last to be truncated once drained (outbox_truncate_wakeups,
// migrations/00064): consumed wake-ups are then gone even while a long
// transaction keeps vacuum from removing them, and claims do not walk them.
// A statement of its own, so the slot's lock is held for milliseconds; it
// never waits for the lock (claims would queue behind it), so most calls
// find a claim in the way or nothing to do. A failure only leaves the dead
// wake-ups in place until a later call.
func (d *Dispatcher) truncateWakeups(ctx context.Context) {
	last := d.truncatedAt.Load()
	now := time.Now().UnixNano()
	if now-last < int64(100*time.Millisecond) || !d.truncatedAt.CompareAndSwap(last, now) {
		return
	}
	d.dbSlots <- struct{}{}
	defer func() { <-d.dbSlots }()
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.MarkTimeout)
	defer cancel()
	if _, err := d.db.Exec(tctx, sqlTruncateWakeups); err != nil {
		d.log.Warn("outbox: truncating consumed wake-ups failed; a later claim retries", "error", err.Error())
	}
}

// idle retires heads a claim found empty. A failure only leaves them ready
// (the next claim looks again), so it is logged, not returned.
func (d *Dispatcher) idle(ctx context.Context, heads []emptyHead) {
	types, ids, wakes := make([]string, len(heads)), make([]string, len(heads)), make([]int64, len(heads))
	for i, h := range heads {
		types[i], ids[i], wakes[i] = h.typ, h.id, h.wakes
	}
	d.dbSlots <- struct{}{}
	defer func() { <-d.dbSlots }()
	ictx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.MarkTimeout)
	defer cancel()
	if _, err := d.db.Exec(ictx, sqlIdleHeads, types, ids, wakes); err != nil {
		d.log.Warn("outbox: retire empty heads failed; the next claim retries", "heads", len(heads), "error", err.Error())
	}
}

// publishRuns publishes every run in order: wave k sends the k-th event of
// each run whose earlier events were all acknowledged, PublishBatchSize
// aggregates per call, PublishConcurrency calls at once. No call starts
// after deadline (zero: none) or once ctx is done (the batch's lease could
// not be renewed); what is left is released, unattempted.
//
// The waves run in a goroutine of their own, watched: if they are still
// running a moment after the deadline or ctx's end (a publisher that
// ignores its context), the batch stops waiting; the events of the calls in
// flight count as retryable failures (ErrPublishAbandoned). If such a call
// does publish later, the copy is one the broker deduplicates (same event
// id), because the retry goes out first.
func (d *Dispatcher) publishRuns(ctx context.Context, runs []*run, deadline time.Time) {
	var (
		mu        sync.Mutex
		abandoned bool
		inFlight  []*run    // the wave being published
		waveStart time.Time // when inFlight's calls started
	)
	done := make(chan struct{})
	go func() {
		defer close(done)
		live := append([]*run(nil), runs...) // filtered in place below; runs is the caller's
		for wave := 0; len(live) > 0; wave++ {
			mu.Lock()
			if abandoned || ctx.Err() != nil || (!deadline.IsZero() && !time.Now().Before(deadline)) {
				mu.Unlock()
				return
			}
			inFlight, waveStart = live, time.Now()
			mu.Unlock()
			msgs := make([]Message, len(live))
			for i, r := range live {
				msgs[i] = r.msgs[wave]
			}
			errs := d.publish(ctx, msgs, deadline)
			mu.Lock()
			if abandoned {
				mu.Unlock()
				return
			}
			next := live[:0]
			for i, r := range live {
				if errs[i] != nil {
					r.err = errs[i]
					continue
				}
				r.done++
				if r.done < len(r.msgs) {
					next = append(next, r)
				}
			}
			live, inFlight = next, nil
			mu.Unlock()
		}
	}()
	abandon := func() {
		mu.Lock()
		abandoned = true
		for _, r := range inFlight {
			r.err = ErrPublishAbandoned
		}
		n := len(inFlight)
		mu.Unlock()
		d.log.Warn("outbox: publish calls overran the batch's deadline; abandoned, their events will be retried", "aggregates", n)
	}
	var graceC <-chan time.Time
	if !deadline.IsZero() {
		grace := time.NewTimer(time.Until(deadline) + d.abandonGrace())
		defer grace.Stop()
		graceC = grace.C
	}
	// A wave whose calls overrun PublishTimeout (a publisher ignoring its
	// context) is abandoned too: the lease is renewed meanwhile, so nothing
	// else would end the batch.
	stuck := time.NewTimer(d.cfg.PublishTimeout + d.abandonGrace())
	defer stuck.Stop()
	for {
		select {
		case <-done:
			return
		case <-graceC:
			abandon()
			return
		case <-ctx.Done():
			cut := time.NewTimer(d.abandonGrace())
			defer cut.Stop()
			select {
			case <-done:
			case <-graceC:
				abandon()
			case <-cut.C:
				abandon()
			}
			return
		case <-stuck.C:
			mu.Lock()
			overdue := waveStart.Add(d.cfg.PublishTimeout + d.abandonGrace())
			mu.Unlock()
			if !time.Now().Before(overdue) {
				abandon()
				return
			}
			stuck.Reset(time.Until(overdue))
		}
	}
}

// publish sends msgs (at most one per aggregate) in chunks of
// PublishBatchSize, PublishConcurrency at a time, and returns one error per
// message. Each call's timeout is PublishTimeout, cut to the deadline. One
// chunk is published by the calling goroutine: a run of one aggregate is a
// long series of one-message calls, and a goroutine hand-off per call cost
// more than the database work per event.
func (d *Dispatcher) publish(ctx context.Context, msgs []Message, deadline time.Time) []error {
	if len(msgs) <= d.cfg.PublishBatchSize {
		return d.call(ctx, msgs, deadline)
	}
	errs := make([]error, len(msgs))
	sem := make(chan struct{}, d.cfg.PublishConcurrency)
	var wg sync.WaitGroup
	for lo := 0; lo < len(msgs); lo += d.cfg.PublishBatchSize {
		hi := min(lo+d.cfg.PublishBatchSize, len(msgs))
		sem <- struct{}{}
		wg.Add(1)
		go func(chunk []Message, out []error) {
			defer wg.Done()
			defer func() { <-sem }()
			copy(out, d.call(ctx, chunk, deadline))
		}(msgs[lo:hi], errs[lo:hi])
	}
	wg.Wait()
	return errs
}

// ErrPublishAbandoned is the outcome of Publish calls still running a
// moment after their batch's deadline: retryable.
var ErrPublishAbandoned = errors.New("outbox: publish call did not return by its batch's deadline; abandoned")

// call runs one Publish call with a deadline (PublishTimeout, cut to the
// batch's) and returns exactly one result per message. A publisher that
// panics or returns the wrong number of results fails the call (retryable)
// instead of killing the dispatcher mid-batch.
func (d *Dispatcher) call(ctx context.Context, chunk []Message, deadline time.Time) (errs []error) {
	end := time.Now().Add(d.cfg.PublishTimeout)
	if !deadline.IsZero() {
		end = minTime(end, deadline)
	}
	pctx, cancel := context.WithDeadline(ctx, end)
	defer cancel()
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			errs = failAll(len(chunk), fmt.Errorf("publisher panicked: %v", r))
		}
		d.observeLatency(time.Since(start))
	}()
	res := d.pub.Publish(pctx, chunk)
	if len(res) != len(chunk) {
		return failAll(len(chunk), errWrongResultCount(len(res), len(chunk)))
	}
	return res
}

func failAll(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// abandonGrace is how long past its deadline a batch's Publish calls are
// waited for: a quarter of MarkTimeout, so recording the outcome still fits.
func (d *Dispatcher) abandonGrace() time.Duration { return d.cfg.MarkTimeout / 4 }

// markArgs are outbox_mark_runs' arrays, one entry per run.
type markArgs struct {
	token                            uuid.UUID
	types, ids, outcomes, errs       []string
	wakes, nextSeqs, delays, failIDs []int64
	ended                            []bool
	sent                             []int64 // for sqlMarkBefore65 only
}

// add records r's outcome: its acknowledged events are sent; the event that
// failed retries after a backoff or, if the failure is permanent or has
// lasted RetryFor (or MaxAttempts is reached), is dead; events after it, or
// cut off by the batch's time limit, are released unattempted.
func (a *markArgs) add(d *Dispatcher, r *run, claimedAt time.Time, res *BatchResult) {
	for _, m := range r.msgs[:r.done] {
		a.sent = append(a.sent, m.ID)
	}
	res.Sent += r.done
	var (
		outcome = "sent"
		next    = r.msgs[len(r.msgs)-1].Sequence + 1
		delay   int64
		text    string
		failID  int64
	)
	if r.done < len(r.msgs) {
		m := r.msgs[r.done]
		next = m.Sequence
		outcome = "released"
		rest := len(r.msgs) - r.done
		if r.err != nil {
			failID, text, rest = m.ID, truncate(r.err.Error(), 1000), rest-1
			failingFor := time.Duration(-1)
			if r.done == 0 && r.retrying >= 0 {
				failingFor = r.retrying + time.Since(claimedAt)
			}
			switch {
			case envelope.IsPermanent(r.err), d.cfg.MaxAttempts > 0 && m.Attempt >= d.cfg.MaxAttempts, failingFor >= d.cfg.RetryFor:
				outcome = "dead"
				res.Dead++
				d.log.Error("outbox event dead", "event_id", m.EventID, "aggregate_type", m.AggregateType, d.aggID(m.GroupID),
					"sequence", m.Sequence, "attempts", m.Attempt, "permanent", envelope.IsPermanent(r.err), "error", text)
			default:
				outcome = "retry"
				delay = d.jitter(d.cfg.BackoffCeiling(m.Attempt)).Milliseconds()
				res.Retried++
			}
		}
		res.Released += rest
	}
	a.types = append(a.types, r.typ)
	a.ids = append(a.ids, r.id)
	a.wakes = append(a.wakes, r.wakes)
	a.nextSeqs = append(a.nextSeqs, next)
	a.outcomes = append(a.outcomes, outcome)
	a.delays = append(a.delays, delay)
	a.errs = append(a.errs, text)
	a.failIDs = append(a.failIDs, failID)
	a.ended = append(a.ended, r.ended)
}

// record records a batch's outcomes (outbox_mark_runs). A mark that fails or
// times out is retried at once with a fresh MarkTimeout (the first attempt
// may have been cut off by a slow server rather than refused; the token
// keeps a second recording from applying twice); if that fails too, the runs
// are released (outbox_release_runs): claimable again at once, so no batch
// waits out its lease because its outcomes could not be written. Released
// runs are published again (their acknowledged events twice; brokers and
// the inbox drop the copies by event id). The lease is renewed meanwhile.
// retried says whether the mark needed its second attempt.
func (d *Dispatcher) record(ctx context.Context, a markArgs, lease *leaseKeeper) (marked int64, retried bool, err error) {
	lease.recording.Store(true)
	n, err := d.mark(ctx, a)
	if err == nil {
		return n, false, nil
	}
	d.log.Warn("outbox: recording a batch's outcomes failed; retrying at once", "runs", len(a.ids), "error", err.Error())
	n, err2 := d.mark(ctx, a)
	if err2 == nil {
		return n, true, nil
	}
	lease.stop() // no renewal may follow the release
	released, err3 := d.release(ctx, a)
	if err3 != nil {
		return 0, true, fmt.Errorf("record publish outcomes: %w; release runs: %w (they are claimed again when their lease ends)",
			errors.Join(err, err2), err3)
	}
	d.log.Warn("outbox: outcomes not recorded; runs released, to be published again", "runs", released, "error", err2.Error())
	return 0, true, fmt.Errorf("record publish outcomes (runs released): %w", errors.Join(err, err2))
}

// mark runs outbox_mark_runs once, within statementDeadline.
func (d *Dispatcher) mark(ctx context.Context, a markArgs) (int64, error) {
	d.dbSlots <- struct{}{}
	defer func() { <-d.dbSlots }()
	mctx, cancel := context.WithDeadline(ctx, d.statementDeadline(ctx))
	defer cancel()
	var n int64
	err := d.db.QueryRow(mctx, sqlMark, a.token, a.types, a.ids, a.wakes, a.nextSeqs, a.outcomes, a.delays,
		a.errs, a.failIDs, a.ended).Scan(&n)
	if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "42883" {
		// undefined_function: a schema not yet migrated to 00065 (this
		// binary deployed before the migration ran).
		err = d.db.QueryRow(mctx, sqlMarkBefore65, a.token, a.types, a.ids, a.wakes, a.nextSeqs, a.outcomes, a.delays,
			a.errs, a.failIDs, a.sent).Scan(&n)
	}
	if err != nil {
		return 0, fmt.Errorf("record publish outcomes: %w", err)
	}
	return n, nil
}

// release gives a batch's runs back unrecorded (outbox_release_runs), within
// statementDeadline.
func (d *Dispatcher) release(ctx context.Context, a markArgs) (int64, error) {
	d.dbSlots <- struct{}{}
	defer func() { <-d.dbSlots }()
	rctx, cancel := context.WithDeadline(ctx, d.statementDeadline(ctx))
	defer cancel()
	var n int64
	if err := d.db.QueryRow(rctx, sqlReleaseRuns, a.token, a.types, a.ids).Scan(&n); err != nil {
		return 0, fmt.Errorf("release runs: %w", err)
	}
	return n, nil
}

func (d *Dispatcher) jitter(ceiling time.Duration) time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	return time.Duration(d.rnd.Int64N(int64(ceiling) + 1))
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
