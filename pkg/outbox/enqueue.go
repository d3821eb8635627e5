package outbox

import (
	"context"
	"errors"
	"fmt"
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
	n := len(events)
	var (
		ids          = make([]string, n)
		types        = make([]string, n)
		occurred     = make([]time.Time, n)
		aggTypes     = make([]string, n)
		aggIDs       = make([]string, n)
		tenants      = make([]string, n)
		correlations = make([]string, n)
		causations   = make([]string, n)
		traceparents = make([]string, n)
		tracestates  = make([]string, n)
		versions     = make([]int64, n)
		payloads     = make([]string, n)
	)
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
		ids[i], types[i], occurred[i], aggTypes[i], aggIDs[i] = e.ID, e.Type, e.OccurredAt, e.AggregateType, e.AggregateID
		tenants[i], correlations[i], causations[i] = e.TenantID, e.CorrelationID, e.CausationID
		traceparents[i], tracestates[i] = e.TraceParent, e.TraceState
		versions[i], payloads[i] = int64(e.SchemaVersion), string(e.Payload)
	}

	// Validated here for typed errors without a round trip; validated again,
	// numbered, encoded and inserted by fifobox_enqueue_events (sqlEnqueue),
	// the only way the producer role reaches the outbox's counters.
	if _, err := tx.Exec(ctx, sqlEnqueue, ids, types, occurred, aggTypes, aggIDs, tenants, correlations, causations,
		traceparents, tracestates, versions, payloads, limit); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == "outbox_event_id_key" {
			return fmt.Errorf("enqueue: %w", ErrDuplicateEvent)
		}
		return fmt.Errorf("enqueue: insert events: %w", err)
	}
	return nil
}
