package inbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Apply is a consumer's side effect for one event, run inside the inbox
// transaction, which it must not end (its Commit and Rollback refuse; the
// engine commits it with the inbox claims). Return envelope.Permanent(err)
// for failures no retry can fix.
type Apply func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error

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
	// claimer writes the inbox claim (nil: fifobox's inbox table).
	claimer *claimer
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
	c := b.claimer
	if c == nil {
		c = defaultClaimer
	}
	tag, err := b.run(ctx, true, c.query(consumer, e))
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
	if err := fn(ctx, effectTx{b.tx}); err != nil {
		return err
	}
	if b.aborted() {
		return errors.New("side effect returned nil but left the transaction aborted (an SQL error was swallowed); the record will be retried")
	}
	return nil
}

// errEndsInboxTx: a side effect tried to commit or roll back the inbox
// transaction it runs in.
var errEndsInboxTx = errors.New("the side effect must not commit or roll back the inbox transaction it runs in (the engine commits it with the inbox claims)")

// effectTx is the transaction a side effect gets: Commit and Rollback
// refuse, so the common mistake (a side effect "committing its work", or a
// deferred Rollback) fails that event instead of ending the batch's
// transaction, with the claims of events not yet applied in it. Begin
// (a savepoint) works as usual.
type effectTx struct{ pgx.Tx }

func (effectTx) Commit(context.Context) error   { return errEndsInboxTx }
func (effectTx) Rollback(context.Context) error { return errEndsInboxTx }

// restart rolls the transaction back and begins a new one.
func (b *batchTx) restart(ctx context.Context, db DB) error {
	b.rollback(ctx)
	b.tx, b.n, b.current, b.broken = nil, 0, "", nil
	return b.begin(ctx, db)
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
