package inbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Apply is a consumer's side effect for one event, run inside the inbox
// transaction. Return envelope.Permanent(err) for failures no retry can fix.
type Apply func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error

// Record is one delivered message as BatchHandler sees it, whatever the
// transport delivered it: the transport turns its own message into a Record
// and settles it by the outcome (pkg/transport/sns for SQS FIFO).
type Record struct {
	// ID is the transport's message id, reported back when the record
	// failed. Required.
	ID string
	// Group is the message group: the aggregate id.
	Group string
	// Body is the message body, an encoded envelope.
	Body []byte
	// ReceiveCount is how often the message was delivered, this time
	// included (SQS ApproximateReceiveCount); 0 if unknown.
	ReceiveCount int
}

// DeadLetterFunc sends r to the dead-letter queue with its failure class
// and reason (never the payload). It must be idempotent per record id: a
// batch whose commit failed is delivered again and may send r again.
type DeadLetterFunc func(ctx context.Context, r Record, class, reason string) error

// Failure classes, as reported in BatchMetrics and DLQ attributes.
const (
	ClassTransient = "transient" // retried through the visibility timeout and maxReceiveCount
	ClassPermanent = "permanent" // the side effect said no retry can help: DLQ at once
	ClassInvalid   = "invalid"   // the message is not a valid envelope: DLQ at once
	ClassExhausted = "exhausted" // failed on its last receive (maxReceiveCount): the handler dead-letters it with the reason
	ClassHeld      = "held"      // strict order: an earlier message of its group is dead-lettered; DLQ behind it
	ClassBlocked   = "blocked"   // not attempted: an earlier message of its group failed
	ClassDeadline  = "deadline"  // not attempted: too close to the invocation's deadline
)

// Order says what a consumer does with an aggregate's later events while
// an earlier one is dead-lettered.
type Order int

const (
	// OrderStrict (the default) holds the group: once the consumer
	// dead-letters a message, every later message of its group (= aggregate)
	// goes to the DLQ behind it, and redrive brings them back in order. The
	// consumer never applies N+1 before N.
	OrderStrict Order = iota
	// OrderRelaxed lets the group continue past a dead-lettered message:
	// later events are applied at once and the dead one, when redriven,
	// arrives after them. For side effects that do not depend on order.
	OrderRelaxed
)

func (o Order) String() string {
	if o == OrderRelaxed {
		return "relaxed"
	}
	return "strict"
}

// ParseOrder parses "strict" or "relaxed" ("" is strict).
func ParseOrder(s string) (Order, error) {
	switch s {
	case "", "strict":
		return OrderStrict, nil
	case "relaxed":
		return OrderRelaxed, nil
	}
	return 0, fmt.Errorf("order %q: want strict or relaxed", s)
}

// DefaultDeadlineMargin is how long before the invocation's deadline the
// handler stops starting records, by default.
const DefaultDeadlineMargin = 3 * time.Second

// BatchMetrics summarises one batch.
type BatchMetrics struct {
	Consumer   string
	Records    int
	Processed  int // side effect applied
	Duplicates int // already applied before
	// Failures by class (transient, permanent, invalid, exhausted, held,
	// blocked, deadline). Dead-lettered records count here too.
	Failures map[string]int
	// MaxLag is the largest now - occurred_at among decoded events.
	MaxLag time.Duration
}

// BatchHandlerConfig configures a BatchHandler.
type BatchHandlerConfig struct {
	// Consumer is the inbox key, e.g. "orders-projection". Required.
	Consumer string
	// Order: OrderStrict (default) or OrderRelaxed; see Order.
	Order Order
	// MaxReceiveCount is the queue's maxReceiveCount. A record failing on
	// its last receive is dead-lettered by the handler (with the reason)
	// instead of being moved by SQS, and in strict order its group is held
	// before the attempt starts, so not even a crash can let the group's
	// next event overtake it. 0: unknown (SQS moves such records, and a
	// strict consumer cannot hold their groups).
	MaxReceiveCount int
	// DeadlineMargin: the handler starts no record once the context's
	// deadline is this close, and reports those records as failed, so the
	// records it finished are committed and acknowledged instead of the
	// whole batch being lost to the timeout. Default DefaultDeadlineMargin.
	// The first record of a batch is always attempted.
	DeadlineMargin time.Duration
	// LogAggregateIDs adds message group ids (= aggregate ids, which may
	// carry personal data) to log lines (FIFOBOX_LOG_AGGREGATE_IDS). Off by
	// default: log lines name message and event ids only.
	LogAggregateIDs bool
	// Logger; default slog.Default().
	Logger *slog.Logger
	// OnBatch, if set, receives each batch's metrics.
	OnBatch func(BatchMetrics)
}

// BatchHandler applies a delivered batch of a FIFO queue's messages the way
// Lambda's SQS FIFO event source needs them (see Handle); the SQS handler
// (pkg/transport/sns) is this over SQS records and an SQS dead-letter queue.
type BatchHandler struct {
	db    DB
	apply Apply
	cfg   BatchHandlerConfig
	log   *slog.Logger
}

// NewBatchHandler returns a BatchHandler applying events with apply.
func NewBatchHandler(db DB, apply Apply, cfg BatchHandlerConfig) (*BatchHandler, error) {
	switch {
	case db == nil:
		return nil, errors.New("new inbox handler: db is nil")
	case apply == nil:
		return nil, errors.New("new inbox handler: apply is nil")
	case cfg.Consumer == "":
		return nil, errors.New("new inbox handler: Consumer is required")
	case cfg.Order != OrderStrict && cfg.Order != OrderRelaxed:
		return nil, fmt.Errorf("new inbox handler: Order %d: want OrderStrict or OrderRelaxed", cfg.Order)
	case cfg.MaxReceiveCount < 0:
		return nil, errors.New("new inbox handler: MaxReceiveCount must not be negative")
	case cfg.DeadlineMargin < 0:
		return nil, errors.New("new inbox handler: DeadlineMargin must not be negative")
	}
	if cfg.DeadlineMargin == 0 {
		cfg.DeadlineMargin = DefaultDeadlineMargin
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &BatchHandler{db: db, apply: apply, cfg: cfg, log: cfg.Logger}, nil
}

// msg is one record of a batch, decoded.
type msg struct {
	Record
	group  string
	e      envelope.Envelope
	badErr error  // why the body is not a valid envelope; nil if it is
	key    string // event id, or sha256 of an invalid body
}

func decodeRecords(recs []Record) []msg {
	out := make([]msg, len(recs))
	for i, r := range recs {
		m := msg{Record: r, group: r.Group}
		m.e, m.badErr = envelope.Decode(r.Body)
		if m.badErr == nil {
			m.key = m.e.ID
		} else {
			sum := sha256.Sum256(r.Body)
			m.key = "sha256:" + hex.EncodeToString(sum[:])
		}
		out[i] = m
	}
	return out
}

// lastReceive reports whether SQS will move r to the DLQ if this attempt fails.
func (h *BatchHandler) lastReceive(r msg) bool {
	if h.cfg.MaxReceiveCount <= 0 {
		return false
	}
	return r.ReceiveCount >= h.cfg.MaxReceiveCount
}

// logAttrs are the attributes naming a record in log lines.
func (h *BatchHandler) logAttrs(r msg, more ...any) []any {
	a := []any{"consumer", h.cfg.Consumer, "message_id", r.ID}
	if r.badErr == nil {
		a = append(a, "event_id", r.e.ID, "sequence", r.e.Sequence)
	}
	if h.cfg.LogAggregateIDs {
		a = append(a, "group", r.group)
	}
	return append(a, more...)
}

// Handle processes a batch in order and returns the ids of the records
// that failed, in order, the way Lambda's SQS FIFO event source needs its
// partial batch failures: once a record fails, it and
// every later record of the same message group are reported failed without
// being run, so the group keeps its order; other groups continue. Permanent
// and invalid records, and records failing on their last receive, go to the
// DLQ at once through dead (with the reason) and count as done. A panic in
// the side effect fails that record instead of the batch. The returned error
// is non-nil only if a record has no id to report (then the whole batch is
// delivered again, which the inbox makes safe).
//
// In strict order (the default) a dead-lettered record holds its group for
// this consumer: the group's later records go to the DLQ behind it (class
// held) until redrive brings them back and they are applied in order.
//
// The batch runs in one transaction, each record under its own savepoint:
// the savepoint and the record's inbox claim go to PostgreSQL in one round
// trip, and one COMMIT covers the batch, so a record costs two round trips
// (claim, side effect) instead of four (begin, claim, side effect, commit).
// In strict order the batch's holds are read in the first record's round
// trip, before its claim counts: if its own group is held, the claim is
// rolled back to the record's savepoint and the record is held instead.
// A failed record rolls back to its own savepoint only, and a side effect
// that leaves the transaction aborted fails its record. If the COMMIT fails,
// nothing of the batch was applied or held and every record is reported
// failed, to be delivered again. Near the deadline (DeadlineMargin) the
// handler starts no more records and reports them failed.
func (h *BatchHandler) Handle(ctx context.Context, batch []Record, dead DeadLetterFunc) ([]string, error) {
	m := BatchMetrics{Consumer: h.cfg.Consumer, Records: len(batch), Failures: map[string]int{}}
	var resp []string
	for _, r := range batch {
		if r.ID == "" {
			return nil, errors.New("inbox: record without a message id; failing the whole batch")
		}
	}
	failed := map[string]bool{}
	fail := func(r msg, class string) {
		resp = append(resp, r.ID)
		failed[r.ID] = true
		m.Failures[class]++
	}
	recs := decodeRecords(batch)
	// Strict order reads the batch's holds before the first record runs.
	// Usually (no record on its last receive, a valid first record) the
	// read rides in the first record's round trip (see claimReadingHolds);
	// otherwise it is a round trip of its own before the transaction.
	var holds *holdSet
	var plan holdPlan
	speculate := false
	if h.cfg.Order == OrderStrict && len(recs) > 0 {
		plan = h.planHolds(recs)
		speculate = len(plan.pg) == 0 && recs[0].badErr == nil
		if !speculate {
			var err error
			if holds, err = h.loadHolds(ctx, plan); err != nil {
				h.log.Warn("inbox: reading held groups failed; the batch will be delivered again", "consumer", h.cfg.Consumer, "error", err.Error())
				for _, r := range recs {
					fail(r, ClassTransient)
				}
				h.finish(m)
				return resp, nil
			}
		}
	}
	var stopAt time.Time
	if dl, ok := ctx.Deadline(); ok {
		stopAt = dl.Add(-h.cfg.DeadlineMargin)
	}
	failedGroups := map[string]bool{}
	var b batchTx
	defer b.rollback(ctx)
	now := time.Now()
	for i, r := range recs {
		if i > 0 && !stopAt.IsZero() && time.Now().After(stopAt) {
			for _, rest := range recs[i:] {
				fail(rest, ClassDeadline)
			}
			h.log.Warn("inbox: invocation deadline close; later records not started, reported failed", "consumer", h.cfg.Consumer,
				"not_started", len(recs)-i, "margin", h.cfg.DeadlineMargin.String())
			break
		}
		if failedGroups[r.group] {
			fail(r, ClassBlocked)
			continue
		}
		if r.badErr == nil {
			if lag := now.Sub(r.e.OccurredAt); lag > m.MaxLag {
				m.MaxLag = lag
			}
		}
		var (
			class     string
			head, dup bool
			done      bool // the record ran in the speculative path
			err       error
		)
		if speculate && i == 0 {
			hs, claimed, cerr := h.claimReadingHolds(ctx, &b, r, plan)
			if cerr != nil {
				// As when the holds cannot be read up front: the claim was
				// rolled back and nothing of the batch ran.
				h.log.Warn("inbox: reading held groups failed; the batch will be delivered again", "consumer", h.cfg.Consumer, "error", cerr.Error())
				for _, r := range recs {
					fail(r, ClassTransient)
				}
				h.finish(m)
				return resp, nil
			}
			holds = hs
			if _, held := holds.head(r.group); !held {
				class, dup, err = h.applyClaimed(r.e.ContextWithTrace(ctx), &b, r, false, claimed)
				done = true
			} else {
				// Its group is held: the claim must not stand. Back to the
				// record's savepoint, then the usual path with the holds.
				b.undo(ctx)
			}
		}
		if !done {
			if head, held := holds.blocked(r.group, r.key); held {
				if err := h.hold(ctx, &b, r, head, dead); err != nil {
					failedGroups[r.group] = true
					fail(r, ClassTransient)
					h.log.Warn("inbox: holding record failed; will retry", h.logAttrs(r, "error", err.Error())...)
					continue
				}
				holds.add(r.group, heldRow{key: r.key, eventID: r.e.ID, seq: r.e.Sequence, class: ClassHeld})
				m.Failures[ClassHeld]++
				continue
			}
			head = holds.isHead(r.group, r.key)
			class, dup, err = h.record(ctx, &b, r, head)
		}
		if err == nil {
			if head {
				holds.pop(r.group)
			}
			if dup {
				m.Duplicates++
			} else {
				m.Processed++
			}
			continue
		}
		if class == ClassTransient && h.lastReceive(r) {
			class = ClassExhausted
		}
		if class == ClassPermanent || class == ClassInvalid || class == ClassExhausted {
			if dlqErr := h.deadLetter(ctx, &b, r, class, err, holds, dead); dlqErr == nil {
				m.Failures[class]++
				continue
			} else {
				h.log.Error("inbox: dead-letter failed; will retry", h.logAttrs(r, "error", dlqErr.Error())...)
			}
		}
		failedGroups[r.group] = true
		fail(r, ClassTransient)
		h.log.Warn("inbox: record failed", h.logAttrs(r, "class", class, "receive_count", r.ReceiveCount, "error", err.Error())...)
	}
	if err := b.commit(ctx); err != nil {
		// Nothing of this batch was applied or held: every record goes back.
		h.log.Warn("inbox: batch commit failed; its records will be delivered again", "consumer", h.cfg.Consumer,
			"records", len(recs), "error", err.Error())
		m.Processed, m.Duplicates = 0, 0
		for _, r := range recs {
			if !failed[r.ID] {
				fail(r, ClassTransient)
			}
		}
	}
	h.finish(m)
	return resp, nil
}

func (h *BatchHandler) finish(m BatchMetrics) {
	if h.cfg.OnBatch != nil {
		h.cfg.OnBatch(m)
	}
}

// record applies one valid record inside the batch transaction, under its
// own savepoint; it returns whether it was a duplicate, or the failure class
// and error. release deletes the record's inbox_held row with it (the record
// is its held group's first).
func (h *BatchHandler) record(ctx context.Context, b *batchTx, r msg, release bool) (class string, dup bool, err error) {
	if r.badErr != nil {
		return ClassInvalid, false, r.badErr
	}
	if err := b.begin(ctx, h.db); err != nil {
		return ClassTransient, false, err
	}
	ctx = r.e.ContextWithTrace(ctx)
	claimed, err := b.claim(ctx, h.cfg.Consumer, r.e)
	if err != nil {
		return ClassTransient, false, err
	}
	return h.applyClaimed(ctx, b, r, release, claimed)
}

// claimReadingHolds starts the batch transaction and claims its first
// record, r, asking in the same round trip whether any of the batch's
// groups is held, so strict order costs no round trip of its own in a batch
// that needs no pre-holds (the held rows, when there are any, take one
// more).
// The claim is speculative: if r's own group turns out to be held the
// caller rolls it back (batchTx.undo) before anything else runs.
func (h *BatchHandler) claimReadingHolds(ctx context.Context, b *batchTx, r msg, p holdPlan) (*holdSet, bool, error) {
	if err := b.begin(ctx, h.db); err != nil {
		return nil, false, err
	}
	// Whether any of the batch's groups is held (almost never) is cheap to
	// plan; the rows are read only when one is, in a round trip of its own.
	var held bool
	read := func(br pgx.BatchResults) error { return br.QueryRow().Scan(&held) }
	tag, err := b.runReading(r.e.ContextWithTrace(ctx), true, &pgx.QueuedQuery{SQL: sqlAnyHeld, Arguments: []any{h.cfg.Consumer, p.groups}}, read,
		&pgx.QueuedQuery{SQL: sqlClaim, Arguments: []any{h.cfg.Consumer, r.e.ID, r.e.AggregateType, r.e.AggregateID, r.e.Sequence}})
	if err != nil {
		return nil, false, fmt.Errorf("inbox claim with holds: %w", err)
	}
	holds := newHoldSet()
	if held {
		batch := &pgx.Batch{}
		batch.Queue(sqlLoadHolds, h.cfg.Consumer, p.groups, p.limit)
		br := b.tx.SendBatch(ctx, batch)
		holds, err = scanHolds(br, p.limit)
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return nil, false, err
		}
	}
	return holds, tag.RowsAffected() == 1, nil
}

// applyClaimed runs r's side effect after its claim (claimed false: the
// event was applied before, nothing runs) and releases its held row if
// release; see record. ctx carries r's trace (ContextWithTrace).
func (h *BatchHandler) applyClaimed(ctx context.Context, b *batchTx, r msg, release, claimed bool) (class string, dup bool, err error) {
	if claimed {
		err = b.effect(ctx, func(ctx context.Context, tx pgx.Tx) error { return h.apply(ctx, tx, r.e) })
	}
	if err == nil && release {
		if _, err = b.tx.Exec(ctx, sqlReleaseHeld, h.cfg.Consumer, r.group, r.key); err != nil {
			err = fmt.Errorf("release held record: %w", err)
		}
	}
	if err != nil {
		b.undo(ctx) // the claim rolls back with the side effect
		if envelope.IsPermanent(err) {
			return ClassPermanent, false, err
		}
		return ClassTransient, false, err
	}
	return "", !claimed, nil
}

// batchTx is a batch's transaction with one savepoint per record. Each
// record's savepoint has its own name (fifobox_record_<n>), so rolling back
// a record can never reach past it into the records applied before; the
// previous record's savepoint is released in the same round trip that sets
// the next one.
type batchTx struct {
	tx      pgx.Tx
	n       int    // records started in this transaction
	current string // the running record's savepoint
	broken  error  // set when the transaction can no longer be used
}

// begin starts the batch transaction on first use.
func (b *batchTx) begin(ctx context.Context, db DB) error {
	if b.broken != nil {
		return fmt.Errorf("batch transaction unusable: %w", b.broken)
	}
	if b.tx != nil {
		return nil
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		b.broken = err
		return fmt.Errorf("inbox begin: %w", err)
	}
	b.tx = tx
	return nil
}

// run sends stmts in one round trip, after a new savepoint for the next
// record if newRecord (releasing the previous record's), and returns the
// last statement's tag. On error it rolls back to the running record's
// savepoint.
func (b *batchTx) run(ctx context.Context, newRecord bool, stmts ...*pgx.QueuedQuery) (pgconn.CommandTag, error) {
	return b.runReading(ctx, newRecord, nil, nil, stmts...)
}

// runReading is run with one query first (if query is not nil) whose rows
// read consumes, in the same round trip.
func (b *batchTx) runReading(ctx context.Context, newRecord bool, query *pgx.QueuedQuery, read func(pgx.BatchResults) error,
	stmts ...*pgx.QueuedQuery) (pgconn.CommandTag, error) {
	batch := &pgx.Batch{}
	if newRecord {
		if b.current != "" {
			batch.Queue("RELEASE SAVEPOINT " + b.current)
		}
		b.n++
		b.current = "fifobox_record_" + strconv.Itoa(b.n)
		batch.Queue("SAVEPOINT " + b.current)
	}
	before := batch.Len()
	if query != nil {
		batch.Queue(query.SQL, query.Arguments...)
	}
	for _, q := range stmts {
		batch.Queue(q.SQL, q.Arguments...)
	}
	br := b.tx.SendBatch(ctx, batch)
	var tag pgconn.CommandTag
	var err error
	for i := 0; i < batch.Len() && err == nil; i++ {
		if i == before && query != nil {
			err = read(br)
			continue
		}
		tag, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		// If the savepoint was not set, undo finds no savepoint of this
		// record and marks the transaction broken: it never rolls back
		// into an earlier record.
		b.undo(ctx)
		return tag, err
	}
	return tag, nil
}

// exec runs one statement for the current record (see run).
func (b *batchTx) exec(ctx context.Context, newRecord bool, sql string, args ...any) error {
	_, err := b.run(ctx, newRecord, &pgx.QueuedQuery{SQL: sql, Arguments: args})
	return err
}

// claim sets the record's savepoint and claims (consumer, event id) in one
// round trip; false means the event was applied before.
func (b *batchTx) claim(ctx context.Context, consumer string, e envelope.Envelope) (bool, error) {
	tag, err := b.run(ctx, true, &pgx.QueuedQuery{SQL: sqlClaim, Arguments: []any{consumer, e.ID, e.AggregateType, e.AggregateID, e.Sequence}})
	if err != nil {
		return false, fmt.Errorf("inbox claim: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// effect runs fn, a record's side effect, in the transaction. A panic in
// fn is an error, and so is a nil return that left the transaction aborted
// (an SQL error swallowed inside fn, or fn ending the transaction): its
// writes did not happen. On error the caller rolls the record back (undo).
func (b *batchTx) effect(ctx context.Context, fn SideEffect) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("side effect panicked: %v", p)
		}
	}()
	if err := fn(ctx, b.tx); err != nil {
		return err
	}
	if b.aborted() {
		return errors.New("side effect returned nil but left the transaction aborted (an SQL error was swallowed); the record will be retried")
	}
	return nil
}

// aborted reports whether the last statement left the transaction failed
// (a side effect swallowed an SQL error) or ended it (a side effect ran
// COMMIT or ROLLBACK itself). PostgreSQL reports the state in every
// ReadyForQuery message, so this costs no round trip.
func (b *batchTx) aborted() bool {
	return b.tx.Conn().PgConn().TxStatus() != 'T'
}

// undo rolls back to the running record's savepoint; if even that fails the
// batch transaction is broken and later records fail without running.
func (b *batchTx) undo(ctx context.Context) {
	if b.current == "" {
		b.broken = errors.New("no savepoint to roll back to")
		return
	}
	if _, err := b.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+b.current); err != nil && b.broken == nil {
		b.broken = err
	}
	if b.broken == nil && b.aborted() {
		b.broken = errors.New("transaction still aborted after rolling back a record")
	}
}

func (b *batchTx) commit(ctx context.Context) error {
	if b.tx == nil {
		return nil
	}
	if b.broken != nil {
		return b.broken
	}
	err := b.tx.Commit(ctx)
	b.tx = nil
	return err
}

func (b *batchTx) rollback(ctx context.Context) {
	if b.tx != nil {
		_ = b.tx.Rollback(context.WithoutCancel(ctx))
	}
}

// deadLetter sends r to the DLQ with the failure's class and reason. In
// strict order it first lists r as its group's hold (or keeps it, if r is
// the group's first row already), in the batch transaction under r's
// savepoint, so the hold and the acknowledgement commit together.
func (h *BatchHandler) deadLetter(ctx context.Context, b *batchTx, r msg, class string, cause error, holds *holdSet, dead DeadLetterFunc) error {
	if holds != nil {
		if err := b.begin(ctx, h.db); err != nil {
			return err
		}
		if err := b.exec(ctx, r.badErr != nil, sqlHold, h.cfg.Consumer, r.group, r.key, nullUUID(r), nullSeq(r), class); err != nil {
			return fmt.Errorf("hold group: %w", err)
		}
		holds.add(r.group, heldRow{key: r.key, eventID: r.e.ID, seq: r.e.Sequence, class: class})
	}
	reason := cause.Error()
	if len(reason) > 1000 {
		reason = reason[:1000]
	}
	if err := dead(ctx, r.Record, class, reason); err != nil {
		return err
	}
	h.log.Error("inbox: message sent to DLQ", h.logAttrs(r, "class", class, "reason", reason, "order", h.cfg.Order.String())...)
	return nil
}

// hold lists r behind its group's first held row and sends it to the DLQ
// with a reason naming the event it waits for.
func (h *BatchHandler) hold(ctx context.Context, b *batchTx, r msg, head heldRow, dead DeadLetterFunc) error {
	if err := b.begin(ctx, h.db); err != nil {
		return err
	}
	if err := b.exec(ctx, true, sqlHold, h.cfg.Consumer, r.group, r.key, nullUUID(r), nullSeq(r), ClassHeld); err != nil {
		return fmt.Errorf("hold record: %w", err)
	}
	waits := "an invalid message (" + head.key + ")"
	if head.eventID != "" {
		waits = fmt.Sprintf("event %s (sequence %d)", head.eventID, head.seq)
	}
	reason := fmt.Sprintf("held: waits for %s, which this consumer dead-lettered (%s); redrive the DLQ to apply the group in order", waits, head.class)
	if err := dead(ctx, r.Record, ClassHeld, reason); err != nil {
		return err
	}
	h.log.Info("inbox: message held behind a dead-lettered one", h.logAttrs(r, "waits_for", waits)...)
	return nil
}
