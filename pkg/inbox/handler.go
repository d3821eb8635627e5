package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5"

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
func (h *Handler) Handle(ctx context.Context, ev events.SQSEvent) (events.SQSEventResponse, error) {
	m := BatchMetrics{Consumer: h.cfg.Consumer, Records: len(ev.Records), Failures: map[string]int{}}
	var resp events.SQSEventResponse
	failedGroups := map[string]bool{}
	now := time.Now()
	for _, r := range ev.Records {
		if r.MessageId == "" {
			return events.SQSEventResponse{}, errors.New("inbox: SQS record without a message id; failing the whole batch")
		}
		group := r.Attributes["MessageGroupId"]
		if failedGroups[group] {
			resp.BatchItemFailures = append(resp.BatchItemFailures, events.SQSBatchItemFailure{ItemIdentifier: r.MessageId})
			m.Failures[ClassBlocked]++
			continue
		}
		class, err := h.record(ctx, r, now, &m)
		if err == nil {
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
		m.Failures[ClassTransient]++
		failedGroups[group] = true
		resp.BatchItemFailures = append(resp.BatchItemFailures, events.SQSBatchItemFailure{ItemIdentifier: r.MessageId})
		h.log.Warn("inbox: record failed", "consumer", h.cfg.Consumer, "message_id", r.MessageId, "group", group,
			"class", class, "receive_count", r.Attributes["ApproximateReceiveCount"], "error", err.Error())
	}
	if h.cfg.OnBatch != nil {
		h.cfg.OnBatch(m)
	}
	return resp, nil
}

// record decodes and applies one record; it returns the failure class and error.
func (h *Handler) record(ctx context.Context, r events.SQSMessage, now time.Time, m *BatchMetrics) (class string, err error) {
	e, err := envelope.Decode([]byte(r.Body))
	if err != nil {
		return ClassInvalid, err
	}
	if lag := now.Sub(e.OccurredAt); lag > m.MaxLag {
		m.MaxLag = lag
	}
	defer func() {
		if p := recover(); p != nil {
			class, err = ClassTransient, fmt.Errorf("side effect panicked: %v", p)
		}
	}()
	out, err := Process(e.ContextWithTrace(ctx), h.db, h.cfg.Consumer, e, func(ctx context.Context, tx pgx.Tx) error {
		return h.apply(ctx, tx, e)
	})
	if err != nil {
		if IsPermanent(err) {
			return ClassPermanent, err
		}
		return ClassTransient, err
	}
	if out == Duplicate {
		m.Duplicates++
	} else {
		m.Processed++
	}
	return "", nil
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
