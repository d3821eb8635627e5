package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
	// BatchSize is the most rows one claim takes. Default 500.
	BatchSize int
	// PublishBatchSize is the most messages per Publisher.Publish call.
	// Default 10, the SNS limit. Entry order inside a call never matters:
	// a claim holds at most one event per aggregate (and snspub sends each
	// group's messages in separate calls, one after the other, regardless).
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
	// claim on the partial pending index costs PostgreSQL next to nothing.
	PollInterval time.Duration
	// MaxAttempts is how many publish attempts an event gets before it is dead. Default 10.
	MaxAttempts int
	// BackoffBase and BackoffCap shape the retry delay: uniform in
	// [0, min(BackoffCap, BackoffBase*2^(attempt-1))] ("full jitter").
	// Defaults 1s and 5m.
	BackoffBase time.Duration
	BackoffCap  time.Duration
	// Lease is how long a claim stays with its dispatcher; after it, a row whose
	// outcome was never recorded (crash) is claimed again. Default 60s.
	Lease time.Duration
	// PublishTimeout bounds one Publish call; it must be shorter than Lease. Default 20s.
	PublishTimeout time.Duration
	// DeadlineMargin: Drain and Run start no claim when the context deadline is
	// closer than this, so an invocation ends with nothing half-done. Default 3s.
	DeadlineMargin time.Duration
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
	def(&c.PublishBatchSize, 10)
	def(&c.PublishConcurrency, 16)
	def(&c.Workers, 4)
	def(&c.MaxAttempts, 10)
	defd(&c.PollInterval, 25*time.Millisecond)
	defd(&c.BackoffBase, time.Second)
	defd(&c.BackoffCap, 5*time.Minute)
	defd(&c.Lease, 60*time.Second)
	defd(&c.PublishTimeout, 20*time.Second)
	defd(&c.DeadlineMargin, 3*time.Second)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports the first invalid field.
func (c DispatcherConfig) Validate() error {
	switch {
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("BatchSize %d: must be 1-10000", c.BatchSize)
	case c.PublishBatchSize < 1 || c.PublishBatchSize > 10:
		return fmt.Errorf("PublishBatchSize %d: must be 1-10 (the SNS PublishBatch limit)", c.PublishBatchSize)
	case c.PublishConcurrency < 1:
		return fmt.Errorf("PublishConcurrency %d: must be at least 1", c.PublishConcurrency)
	case c.Workers < 1:
		return fmt.Errorf("Workers %d: must be at least 1", c.Workers)
	case c.MaxAttempts < 1:
		return fmt.Errorf("MaxAttempts %d: must be at least 1", c.MaxAttempts)
	case c.PollInterval <= 0:
		return fmt.Errorf("PollInterval %s: must be positive", c.PollInterval)
	case c.BackoffBase <= 0 || c.BackoffCap < c.BackoffBase:
		return fmt.Errorf("BackoffBase %s, BackoffCap %s: need 0 < base <= cap", c.BackoffBase, c.BackoffCap)
	case c.Lease < time.Second:
		return fmt.Errorf("Lease %s: must be at least 1s", c.Lease)
	case c.PublishTimeout <= 0 || c.PublishTimeout >= c.Lease:
		return fmt.Errorf("PublishTimeout %s: must be positive and shorter than Lease %s", c.PublishTimeout, c.Lease)
	case c.DeadlineMargin < 0:
		return fmt.Errorf("DeadlineMargin %s: must not be negative", c.DeadlineMargin)
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
	Claimed int
	Sent    int
	Retried int
	Dead    int
	// Lost counts rows whose lease expired before their outcome was recorded;
	// another dispatcher owns them now.
	Lost int
	// PublishDuration is the wall time of the publish step.
	PublishDuration time.Duration
	// Sent events' commit-to-publish ages are not known here; see Stats for lag.
}

// Totals are a dispatcher's cumulative counts since it was created.
type Totals struct {
	Claimed, Sent, Retried, Dead, Lost int64
}

// Dispatcher moves events from the outbox to a Publisher, preserving
// per-aggregate order.
//
// Ordering design: the claim query takes only each aggregate's head, the
// lowest-sequence event that is not yet sent, and only while no earlier event
// of its aggregate is pending, claimed, retrying or dead. A claimed row keeps
// state 'pending' under a lease, so event N+1 of an aggregate cannot be
// claimed, by this or any other dispatcher, until N is marked sent, and a
// retrying or dead event holds back only its own aggregate. FOR UPDATE SKIP
// LOCKED lets any number of dispatchers claim disjoint heads concurrently
// without coordination. We chose this over sharding aggregates across
// dispatchers with leases because it needs no membership protocol, keeps
// working with one dispatcher or fifty (overlapping Lambda invocations), and
// needs no session state (RDS Proxy friendly). The price is one in-flight
// event per aggregate: a single very hot aggregate publishes one event per
// round trip, which is also what SNS FIFO's per-group ordering implies.
type Dispatcher struct {
	db  DB
	pub Publisher
	cfg DispatcherConfig
	log *slog.Logger

	mu  sync.Mutex
	rnd *rand.Rand

	// claimMu guards the claim cursor: where the next claim starts in the
	// current sweep (0: from the beginning), and span, the id range the last
	// full batch covered.
	claimMu sync.Mutex
	cursor  int64
	span    int64
	// dbSlots bounds this dispatcher's concurrent statements (claims and
	// marks) to two: more batches may be publishing at once (Workers), but
	// more statements at once only contend for the database's CPU.
	dbSlots chan struct{}

	claimed, sent, retried, dead, lost atomic.Int64
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
		dbSlots: make(chan struct{}, 2),
	}, nil
}

// Config returns the effective configuration (defaults applied).
func (d *Dispatcher) Config() DispatcherConfig { return d.cfg }

// Totals returns cumulative counts.
func (d *Dispatcher) Totals() Totals {
	return Totals{Claimed: d.claimed.Load(), Sent: d.sent.Load(), Retried: d.retried.Load(), Dead: d.dead.Load(), Lost: d.lost.Load()}
}

// RunOnce claims one batch, publishes it and records every outcome. Once a
// batch is claimed it is finished even if ctx is cancelled (publishing and
// marking use their own timeouts), so a stop never leaves rows half-done;
// a crash leaves them leased, and they are claimed again after the lease.
func (d *Dispatcher) RunOnce(ctx context.Context) (BatchResult, error) {
	if err := ctx.Err(); err != nil {
		return BatchResult{}, err
	}
	token := uuid.New()
	msgs, err := d.claim(ctx, token)
	if err != nil {
		return BatchResult{}, err
	}
	if len(msgs) == 0 {
		return BatchResult{}, nil
	}
	res := BatchResult{Claimed: len(msgs)}
	d.claimed.Add(int64(len(msgs)))

	work := context.WithoutCancel(ctx)
	start := time.Now()
	errs := d.publish(work, msgs)
	res.PublishDuration = time.Since(start)

	ids := make([]int64, len(msgs))
	outcomes := make([]string, len(msgs))
	delays := make([]int64, len(msgs))
	texts := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
		switch err := errs[i]; {
		case err == nil:
			outcomes[i] = "sent"
			res.Sent++
		case IsPermanent(err) || m.Attempt >= d.cfg.MaxAttempts:
			outcomes[i] = "dead"
			texts[i] = truncate(err.Error(), 1000)
			res.Dead++
			d.log.Error("outbox event dead", "event_id", m.EventID, "aggregate_type", m.AggregateType,
				"aggregate_id", m.GroupID, "sequence", m.Sequence, "attempts", m.Attempt, "error", texts[i])
		default:
			outcomes[i] = "retry"
			texts[i] = truncate(err.Error(), 1000)
			delays[i] = d.jitter(d.cfg.BackoffCeiling(m.Attempt)).Milliseconds()
			res.Retried++
		}
	}
	marked, err := d.mark(work, ids, outcomes, delays, texts, token)
	if err != nil {
		// Outcomes not recorded: the rows stay leased and are published again
		// after the lease (a duplicate, which SNS deduplicates by event id).
		return res, err
	}
	res.Lost = len(msgs) - int(marked)
	if res.Lost > 0 {
		d.log.Warn("outbox claim lease expired before outcomes were recorded", "rows", res.Lost, "lease", d.cfg.Lease.String())
	}
	d.sent.Add(int64(res.Sent))
	d.retried.Add(int64(res.Retried))
	d.dead.Add(int64(res.Dead))
	d.lost.Add(int64(res.Lost))
	if d.cfg.OnBatch != nil {
		d.cfg.OnBatch(res)
	}
	return res, nil
}

// Drain runs batches with Workers loops until nothing is due (the backlog is
// empty or everything left is waiting for backoff or parked), ctx is done, or
// ctx's deadline is closer than DeadlineMargin. It returns the first error.
//
// A claim that comes back short or empty does not mean the backlog is
// drained: the next event of every aggregate in flight becomes claimable
// only once its predecessor is marked sent. So Drain stops only when a claim
// finds nothing while no other worker has a batch in flight.
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

				mu.Lock()
				busy--
				if res.Claimed > 0 {
					finished++
				}
				if err == nil && res.Claimed == 0 {
					// Nothing claimable now. If another batch is in flight,
					// wait for it: it frees its aggregates' next events.
					// (Claiming again at once would only re-scan the
					// waiting events.) Empty when nothing was in flight or
					// finished since our claim began.
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
						errOnce.Do(func() { firstErr = err })
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
// broker down) are logged and retried with backoff; Run returns nil when it
// stops. This is what the scheduled Lambda calls.
func (d *Dispatcher) Run(ctx context.Context) error {
	stopAt, hasDeadline := d.stopAt(ctx)
	failures := 0
	for {
		err := d.Drain(ctx)
		wait := d.cfg.PollInterval
		if err != nil {
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

// claim takes the next batch. The claim is the costliest statement, so two
// workers of one dispatcher may claim at once (see dbSlots): a claim starts
// where the one before it is expected to end (its start plus the id span of
// the last full batch), so the two rarely scan the same rows. A wrong guess
// costs only rows read (SKIP LOCKED and the lease filter pass over rows
// another claim took); correctness rests on the claim query alone.
func (d *Dispatcher) claim(ctx context.Context, token uuid.UUID) ([]Message, error) {
	select {
	case d.dbSlots <- struct{}{}:
	case <-ctx.Done(): // nothing claimed yet: stopping now leaves nothing half-done
		return nil, ctx.Err()
	}
	defer func() { <-d.dbSlots }()
	d.claimMu.Lock()
	from := d.cursor
	if from > 0 {
		d.cursor = from + d.span
	}
	d.claimMu.Unlock()

	msgs, err := d.claimAfter(ctx, token, from, d.cfg.BatchSize)
	if err != nil {
		d.resetCursor()
		return nil, err
	}
	if len(msgs) < d.cfg.BatchSize && from > 0 {
		// The sweep reached the end: start over from the beginning, where
		// retries and newly unblocked heads wait, and fill the batch.
		more, err := d.claimAfter(ctx, token, 0, d.cfg.BatchSize-len(msgs))
		if err != nil && len(msgs) == 0 {
			d.resetCursor()
			return nil, err
		}
		// On error the first part is claimed: publish it rather than wait
		// for its lease.
		msgs = append(msgs, more...)
	}

	d.claimMu.Lock()
	defer d.claimMu.Unlock()
	if len(msgs) == d.cfg.BatchSize {
		var lo, hi int64 = msgs[0].ID, msgs[0].ID
		for _, m := range msgs {
			lo, hi = min(lo, m.ID), max(hi, m.ID)
		}
		d.cursor = max(d.cursor, hi)
		d.span = hi - lo + 1
	} else {
		d.cursor = 0
	}
	return msgs, nil
}

func (d *Dispatcher) resetCursor() {
	d.claimMu.Lock()
	d.cursor = 0
	d.claimMu.Unlock()
}

func (d *Dispatcher) claimAfter(ctx context.Context, token uuid.UUID, after int64, limit int) ([]Message, error) {
	// The claim gets its own timeout rather than the caller's deadline: a
	// cancelled statement would need a CancelRequest, which RDS Proxy lacks.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.PublishTimeout)
	defer cancel()
	rows, err := d.db.Query(cctx, sqlClaim, limit, token, d.cfg.Lease.Milliseconds(), after)
	if err != nil {
		return nil, fmt.Errorf("claim batch: %w", err)
	}
	defer rows.Close()
	msgs := make([]Message, 0, limit)
	for rows.Next() {
		var m Message
		var tenant, traceparent string
		if err := rows.Scan(&m.ID, &m.EventID, &m.AggregateType, &m.GroupID, &m.Sequence,
			&m.EventType, &tenant, &traceparent, &m.Attempt, &m.Body); err != nil {
			return nil, fmt.Errorf("claim batch: scan: %w", err)
		}
		m.Attributes = attributes(m.EventType, m.AggregateType, tenant, traceparent)
		m.DedupID = m.EventID
		msgs = append(msgs, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim batch: %w", err)
	}
	return msgs, nil
}

// publish sends msgs in chunks of PublishBatchSize, PublishConcurrency at a
// time, and returns one error per message. A panicking publisher fails its
// chunk (retryable) instead of killing the dispatcher mid-batch.
func (d *Dispatcher) publish(ctx context.Context, msgs []Message) []error {
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
			defer func() {
				if r := recover(); r != nil {
					for i := range out {
						out[i] = fmt.Errorf("publisher panicked: %v", r)
					}
				}
			}()
			pctx, cancel := context.WithTimeout(ctx, d.cfg.PublishTimeout)
			defer cancel()
			res := d.pub.Publish(pctx, chunk)
			if len(res) != len(chunk) {
				err := errWrongResultCount(len(res), len(chunk))
				for i := range out {
					out[i] = err
				}
				return
			}
			copy(out, res)
		}(msgs[lo:hi], errs[lo:hi])
	}
	wg.Wait()
	return errs
}

// mark records outcomes, retrying briefly: a lost mark means duplicates later.
func (d *Dispatcher) mark(ctx context.Context, ids []int64, outcomes []string, delays []int64, texts []string, token uuid.UUID) (int64, error) {
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt*attempt) * 100 * time.Millisecond)
		}
		d.dbSlots <- struct{}{}
		mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var tag pgconn.CommandTag
		var err error
		if allSent(outcomes) {
			tag, err = d.db.Exec(mctx, sqlMarkSent, ids, token)
		} else {
			tag, err = d.db.Exec(mctx, sqlMark, ids, outcomes, delays, texts, token)
		}
		cancel()
		<-d.dbSlots
		if err == nil {
			return tag.RowsAffected(), nil
		}
		lastErr = err
	}
	return 0, fmt.Errorf("record publish outcomes: %w", lastErr)
}

func allSent(outcomes []string) bool {
	for _, o := range outcomes {
		if o != "sent" {
			return false
		}
	}
	return true
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
