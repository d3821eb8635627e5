package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Apply is a consumer's side effect for one event, run inside the inbox
// transaction. Return Permanent(err) for failures no retry can fix.
type Apply func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error

// DLQSender sends a message to the dead-letter queue; *sqs.Client satisfies it.
type DLQSender interface {
	SendMessage(ctx context.Context, in *sqs.SendMessageInput, optFns ...func(*sqs.Options)) (*sqs.SendMessageOutput, error)
}

// Failure classes, as reported in BatchMetrics and DLQ attributes.
const (
	ClassTransient = "transient" // retried through the visibility timeout and maxReceiveCount
	ClassPermanent = "permanent" // the side effect said no retry can help: DLQ at once
	ClassInvalid   = "invalid"   // the message is not a valid envelope: DLQ at once
	ClassBlocked   = "blocked"   // not attempted: an earlier message of its group failed
)

// DLQ message attribute names set when a message is dead-lettered directly.
const (
	AttrErrorClass  = "fifobox_error_class"
	AttrErrorReason = "fifobox_error_reason"
	AttrConsumer    = "fifobox_consumer"
	AttrSourceQueue = "fifobox_source_queue"
)

// BatchMetrics summarises one batch.
type BatchMetrics struct {
	Consumer   string
	Records    int
	Processed  int // side effect applied
	Duplicates int // already applied before
	// Failures by class (transient, permanent, invalid, blocked).
	Failures map[string]int
	// MaxLag is the largest now - occurred_at among decoded events.
	MaxLag time.Duration
}

// HandlerConfig configures a Handler.
type HandlerConfig struct {
	// Consumer is the inbox key, e.g. "orders-projection". Required.
	Consumer string
	// DLQURL is the queue's dead-letter queue for permanent and invalid
	// messages. Required: without it such messages would be retried until
	// maxReceiveCount moves them anyway.
	DLQURL string
	// Logger; default slog.Default().
	Logger *slog.Logger
	// OnBatch, if set, receives each batch's metrics.
	OnBatch func(BatchMetrics)
}

// Handler is the SQS FIFO batch handler for a consumer Lambda.
type Handler struct {
	db    DB
	dlq   DLQSender
	apply Apply
	cfg   HandlerConfig
	log   *slog.Logger
}

// NewHandler returns a Handler applying events with apply.
func NewHandler(db DB, dlq DLQSender, apply Apply, cfg HandlerConfig) (*Handler, error) {
	switch {
	case db == nil:
		return nil, errors.New("new inbox handler: db is nil")
	case dlq == nil:
		return nil, errors.New("new inbox handler: dlq sender is nil")
	case apply == nil:
		return nil, errors.New("new inbox handler: apply is nil")
	case cfg.Consumer == "":
		return nil, errors.New("new inbox handler: Consumer is required")
	case cfg.DLQURL == "":
		return nil, errors.New("new inbox handler: DLQURL is required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Handler{db: db, dlq: dlq, apply: apply, cfg: cfg, log: cfg.Logger}, nil
}

// Handle processes a batch in order and reports partial failures the way
// Lambda's SQS FIFO event source needs them: once a record fails, it and
// every later record of the same message group are reported failed without
// being run, so the group keeps its order; other groups continue. Permanent
// and invalid records go to the DLQ at once (with the reason) and count as
// done. A panic in the side effect fails that record instead of the batch.
// The returned error is non-nil only if a record has no message id to report
// (then Lambda retries the whole batch, which the inbox makes safe).
//
// The batch runs in one transaction, each record under its own savepoint:
// the savepoint and the record's inbox claim go to PostgreSQL in one round
// trip, and one COMMIT covers the batch, so a record costs two round trips
// (claim, side effect) instead of four (begin, claim, side effect, commit).
// A failed record rolls back to its savepoint only. If the COMMIT fails,
// nothing of the batch was applied and every record it ran is reported
// failed, to be delivered again.
func (h *Handler) Handle(ctx context.Context, ev events.SQSEvent) (events.SQSEventResponse, error) {
	m := BatchMetrics{Consumer: h.cfg.Consumer, Records: len(ev.Records), Failures: map[string]int{}}
	var resp events.SQSEventResponse
	for _, r := range ev.Records {
		if r.MessageId == "" {
			return events.SQSEventResponse{}, errors.New("inbox: SQS record without a message id; failing the whole batch")
		}
	}
	fail := func(r events.SQSMessage, class string) {
		resp.BatchItemFailures = append(resp.BatchItemFailures, events.SQSBatchItemFailure{ItemIdentifier: r.MessageId})
		m.Failures[class]++
	}
	failedGroups := map[string]bool{}
	var applied []events.SQSMessage // run in the batch transaction, pending its commit
	var b batchTx
	defer b.rollback(ctx)
	now := time.Now()
	for _, r := range ev.Records {
		group := r.Attributes["MessageGroupId"]
		if failedGroups[group] {
			fail(r, ClassBlocked)
			continue
		}
		class, dup, err := h.record(ctx, &b, r, now, &m)
		if err == nil {
			applied = append(applied, r)
			if dup {
				m.Duplicates++
			} else {
				m.Processed++
			}
			continue
		}
		if class == ClassPermanent || class == ClassInvalid {
			if dlqErr := h.deadLetter(ctx, r, group, class, err); dlqErr == nil {
				m.Failures[class]++
				continue
			} else {
				h.log.Error("inbox: dead-letter send failed; will retry", "consumer", h.cfg.Consumer, "message_id", r.MessageId, "error", dlqErr.Error())
			}
		}
		failedGroups[group] = true
		fail(r, ClassTransient)
		h.log.Warn("inbox: record failed", "consumer", h.cfg.Consumer, "message_id", r.MessageId, "group", group,
			"class", class, "receive_count", r.Attributes["ApproximateReceiveCount"], "error", err.Error())
	}
	if err := b.commit(ctx); err != nil {
		// Nothing of this batch was applied: every record it ran goes back.
		h.log.Warn("inbox: batch commit failed; its records will be delivered again", "consumer", h.cfg.Consumer,
			"records", len(applied), "error", err.Error())
		m.Processed, m.Duplicates = 0, 0
		for _, r := range applied {
			fail(r, ClassTransient)
		}
	}
	if h.cfg.OnBatch != nil {
		h.cfg.OnBatch(m)
	}
	return resp, nil
}

// record decodes and applies one record inside the batch transaction; it
// returns whether it was a duplicate, or the failure class and error.
func (h *Handler) record(ctx context.Context, b *batchTx, r events.SQSMessage, now time.Time, m *BatchMetrics) (class string, dup bool, err error) {
	e, err := envelope.Decode([]byte(r.Body))
	if err != nil {
		return ClassInvalid, false, err
	}
	if lag := now.Sub(e.OccurredAt); lag > m.MaxLag {
		m.MaxLag = lag
	}
	if b.broken != nil {
		return ClassTransient, false, fmt.Errorf("batch transaction unusable: %w", b.broken)
	}
	if b.tx == nil {
		if b.tx, err = h.db.Begin(ctx); err != nil {
			b.broken = err
			return ClassTransient, false, fmt.Errorf("inbox begin: %w", err)
		}
	}
	ctx = e.ContextWithTrace(ctx)
	claimed, err := b.claim(ctx, h.cfg.Consumer, e)
	if err != nil {
		return ClassTransient, false, err
	}
	if !claimed {
		return "", true, nil // applied before: nothing to do
	}
	err = func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("side effect panicked: %v", p)
			}
		}()
		return h.apply(ctx, b.tx, e)
	}()
	if err == nil && b.aborted() {
		// The side effect returned nil but an SQL error inside it was
		// swallowed (or it ended the transaction): its writes did not
		// happen. Fail the record, rolling back to its own savepoint only.
		err = errors.New("side effect returned nil but left the transaction aborted (an SQL error was swallowed); the record will be retried")
	}
	if err != nil {
		b.undo(ctx) // the claim rolls back with the side effect
		if IsPermanent(err) {
			return ClassPermanent, false, err
		}
		return ClassTransient, false, err
	}
	return "", false, nil
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

// claim sets the record's savepoint and claims (consumer, event id) in one
// round trip; false means the event was applied before.
func (b *batchTx) claim(ctx context.Context, consumer string, e envelope.Envelope) (bool, error) {
	batch := &pgx.Batch{}
	if b.current != "" {
		batch.Queue("RELEASE SAVEPOINT " + b.current)
	}
	b.n++
	b.current = "fifobox_record_" + strconv.Itoa(b.n)
	batch.Queue("SAVEPOINT " + b.current)
	batch.Queue(sqlClaim, consumer, e.ID, e.AggregateType, e.AggregateID, e.Sequence)
	br := b.tx.SendBatch(ctx, batch)
	var tag pgconn.CommandTag
	var err error
	for i := 0; i < batch.Len() && err == nil; i++ {
		tag, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		// The savepoint may not exist: undo only rolls back to this
		// record's own savepoint, or else marks the transaction broken.
		b.undo(ctx)
		return false, fmt.Errorf("inbox claim: %w", err)
	}
	return tag.RowsAffected() == 1, nil
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

func (h *Handler) deadLetter(ctx context.Context, r events.SQSMessage, group, class string, cause error) error {
	if group == "" {
		group = "fifobox-invalid"
	}
	reason := cause.Error()
	if len(reason) > 1000 {
		reason = reason[:1000]
	}
	str := func(s string) sqstypes.MessageAttributeValue {
		return sqstypes.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(s)}
	}
	body := r.Body
	if body == "" {
		body = "(empty body)"
	}
	_, err := h.dlq.SendMessage(ctx, &sqs.SendMessageInput{
		QueueUrl:               aws.String(h.cfg.DLQURL),
		MessageBody:            aws.String(body),
		MessageGroupId:         aws.String(group),
		MessageDeduplicationId: aws.String(r.MessageId),
		MessageAttributes: map[string]sqstypes.MessageAttributeValue{
			AttrErrorClass:  str(class),
			AttrErrorReason: str(reason),
			AttrConsumer:    str(h.cfg.Consumer),
			AttrSourceQueue: str(orDash(r.EventSourceARN)),
		},
	})
	if err == nil {
		h.log.Error("inbox: message sent to DLQ", "consumer", h.cfg.Consumer, "message_id", r.MessageId, "group", group, "class", class, "reason", reason)
	}
	return err
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
