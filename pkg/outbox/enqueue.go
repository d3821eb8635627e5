package outbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Writer enqueues events. The zero value uses the default size limit.
type Writer struct {
	// MaxMessageBytes limits one published message, body plus attributes.
	// Default and upper bound envelope.DefaultMaxMessageBytes (256 KiB, the
	// SNS limit): a larger event could never be published.
	MaxMessageBytes int
}

// Enqueue writes events to the outbox inside the caller's transaction, with
// the default Writer. See Writer.Enqueue.
func Enqueue(ctx context.Context, tx pgx.Tx, events ...envelope.Envelope) error {
	return Writer{}.Enqueue(ctx, tx, events...)
}

// Enqueue validates every event, assigns each its next sequence number within
// its aggregate (in the order given) and inserts them, all inside tx. The
// events exist if and only if tx commits.
//
// An invalid event fails the whole call before anything is written: the error
// wraps the event's *envelope.ValidationError and names its index. The
// Sequence field of the given events is ignored; the outbox assigns it.
func (w Writer) Enqueue(ctx context.Context, tx pgx.Tx, events ...envelope.Envelope) error {
	if len(events) == 0 {
		return nil
	}
	limit := w.MaxMessageBytes
	if limit <= 0 {
		limit = envelope.DefaultMaxMessageBytes
	}
	if limit > envelope.DefaultMaxMessageBytes {
		return fmt.Errorf("enqueue: Writer.MaxMessageBytes %d: must be at most %d (the SNS message limit)", limit, envelope.DefaultMaxMessageBytes)
	}
	seen := make(map[string]int, len(events))
	type aggKey struct{ typ, id string }
	counts := map[aggKey]int64{}
	for i, e := range events {
		e.Sequence = 0
		if err := e.ValidateWithLimit(limit); err != nil {
			return fmt.Errorf("enqueue event %d: %w", i, err)
		}
		if j, dup := seen[e.ID]; dup {
			return fmt.Errorf("enqueue event %d: %w", i, &envelope.ValidationError{
				Field: "id", Kind: envelope.ErrInvalid, Reason: fmt.Sprintf("same id as event %d", j)})
		}
		seen[e.ID] = i
		counts[aggKey{e.AggregateType, e.AggregateID}]++
	}

	// Reserve sequence ranges. Aggregates are sorted so that concurrent
	// transactions lock them in the same order and cannot deadlock.
	keys := make([]aggKey, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].typ != keys[j].typ {
			return keys[i].typ < keys[j].typ
		}
		return keys[i].id < keys[j].id
	})
	types := make([]string, len(keys))
	ids := make([]string, len(keys))
	ns := make([]int64, len(keys))
	for i, k := range keys {
		types[i], ids[i], ns[i] = k.typ, k.id, counts[k]
	}
	rows, err := tx.Query(ctx, sqlReserveSeq, types, ids, ns)
	if err != nil {
		return fmt.Errorf("enqueue: reserve sequence: %w", err)
	}
	next := make(map[aggKey]int64, len(keys))
	for rows.Next() {
		var k aggKey
		var last int64
		if err := rows.Scan(&k.typ, &k.id, &last); err != nil {
			rows.Close()
			return fmt.Errorf("enqueue: reserve sequence: %w", err)
		}
		next[k] = last - counts[k] + 1
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("enqueue: reserve sequence: %w", err)
	}

	n := len(events)
	var (
		eventIDs    = make([]string, n)
		eventTypes  = make([]string, n)
		aggTypes    = make([]string, n)
		aggIDs      = make([]string, n)
		seqs        = make([]int64, n)
		tenants     = make([]string, n)
		traceparent = make([]string, n)
		occurred    = make([]time.Time, n)
		bodies      = make([][]byte, n)
	)
	for i, e := range events {
		k := aggKey{e.AggregateType, e.AggregateID}
		e.Sequence = next[k]
		next[k]++
		body, err := e.Encode()
		if err != nil {
			return fmt.Errorf("enqueue event %d: %w", i, err)
		}
		eventIDs[i], eventTypes[i], aggTypes[i], aggIDs[i] = e.ID, e.Type, e.AggregateType, e.AggregateID
		seqs[i], tenants[i], traceparent[i], occurred[i], bodies[i] = e.Sequence, e.TenantID, e.TraceParent, e.OccurredAt, body
	}
	if _, err := tx.Exec(ctx, sqlInsertEvents, eventIDs, eventTypes, aggTypes, aggIDs, seqs, tenants, traceparent, occurred, bodies,
		types, ids); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == "outbox_event_id_key" {
			return fmt.Errorf("enqueue: %w", ErrDuplicateEvent)
		}
		return fmt.Errorf("enqueue: insert events: %w", err)
	}
	return nil
}
