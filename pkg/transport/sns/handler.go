package sns

import (
	"context"
	"errors"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/fifobox/fifobox/pkg/inbox"
)

// DLQSender sends a message to the dead-letter queue; *sqs.Client satisfies it.
type DLQSender interface {
	SendMessage(ctx context.Context, in *sqs.SendMessageInput, optFns ...func(*sqs.Options)) (*sqs.SendMessageOutput, error)
}

// DLQ message attribute names set when the handler dead-letters a message
// itself (SQS moves messages after maxReceiveCount without them).
const (
	AttrErrorClass  = "fifobox_error_class"
	AttrErrorReason = "fifobox_error_reason"
	AttrConsumer    = "fifobox_consumer"
	AttrSourceQueue = "fifobox_source_queue"
)

// HandlerConfig configures a Handler.
type HandlerConfig struct {
	// Consumer is the inbox key, e.g. "orders-projection". Required.
	Consumer string
	// DLQURL is the queue's dead-letter queue for permanent and invalid
	// messages. Required: without it such messages would be retried until
	// maxReceiveCount moves them anyway.
	DLQURL string
	// Order: inbox.OrderStrict (default) or inbox.OrderRelaxed; see inbox.Order.
	Order inbox.Order
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
	// whole batch being lost to the timeout. Default
	// inbox.DefaultDeadlineMargin. The first record of a batch is always
	// attempted.
	DeadlineMargin time.Duration
	// LogAggregateIDs adds message group ids (= aggregate ids, which may
	// carry personal data) to log lines (FIFOBOX_LOG_AGGREGATE_IDS). Off by
	// default: log lines name message and event ids only.
	LogAggregateIDs bool
	// Logger; default slog.Default().
	Logger *slog.Logger
	// OnBatch, if set, receives each batch's metrics.
	OnBatch func(inbox.BatchMetrics)
}

// Handler is the SQS FIFO batch handler for a consumer Lambda (and for
// Runner, its local stand-in): inbox.BatchHandler over SQS records, with
// this queue's DLQ for what it dead-letters.
type Handler struct {
	b   *inbox.BatchHandler
	dlq DLQSender
	cfg HandlerConfig
}

// NewHandler returns a Handler applying events with apply.
func NewHandler(db inbox.DB, dlq DLQSender, apply inbox.Apply, cfg HandlerConfig) (*Handler, error) {
	switch {
	case dlq == nil:
		return nil, errors.New("new inbox handler: dlq sender is nil")
	case cfg.DLQURL == "":
		return nil, errors.New("new inbox handler: DLQURL is required")
	}
	b, err := inbox.NewBatchHandler(db, apply, inbox.BatchHandlerConfig{Consumer: cfg.Consumer, Order: cfg.Order,
		MaxReceiveCount: cfg.MaxReceiveCount, DeadlineMargin: cfg.DeadlineMargin, LogAggregateIDs: cfg.LogAggregateIDs,
		Logger: cfg.Logger, OnBatch: cfg.OnBatch})
	if err != nil {
		return nil, err
	}
	return &Handler{b: b, dlq: dlq, cfg: cfg}, nil
}

// Handle processes a batch in order and reports partial failures the way
// Lambda's SQS FIFO event source needs them (inbox.BatchHandler.Handle):
// once a record fails, it and every later record of the same message group
// are reported failed without being run; permanent and invalid records, and
// records failing on their last receive, go to the DLQ at once with the
// reason; in strict order a dead-lettered record holds its group. The
// returned error is non-nil only if a record has no message id to report
// (then Lambda retries the whole batch, which the inbox makes safe).
func (h *Handler) Handle(ctx context.Context, ev events.SQSEvent) (events.SQSEventResponse, error) {
	recs := make([]inbox.Record, len(ev.Records))
	byID := make(map[string]*events.SQSMessage, len(ev.Records))
	for i := range ev.Records {
		r := &ev.Records[i]
		n, _ := strconv.Atoi(r.Attributes["ApproximateReceiveCount"])
		recs[i] = inbox.Record{ID: r.MessageId, Group: r.Attributes["MessageGroupId"], Body: []byte(r.Body), ReceiveCount: n}
		byID[r.MessageId] = r
	}
	failed, err := h.b.Handle(ctx, recs, func(ctx context.Context, rec inbox.Record, class, reason string) error {
		return h.send(ctx, byID[rec.ID], rec.Group, class, reason)
	})
	if err != nil {
		return events.SQSEventResponse{}, err
	}
	var resp events.SQSEventResponse
	for _, id := range failed {
		resp.BatchItemFailures = append(resp.BatchItemFailures, events.SQSBatchItemFailure{ItemIdentifier: id})
	}
	return resp, nil
}

// send puts r on the DLQ: same body and group, r's string attributes, and
// the fifobox_* diagnostics. The deduplication id is r's message id, so a
// record sent again (its batch failed to commit) is not duplicated.
func (h *Handler) send(ctx context.Context, r *events.SQSMessage, group, class, reason string) error {
	if group == "" {
		group = "fifobox-invalid"
	}
	str := func(s string) sqstypes.MessageAttributeValue {
		return sqstypes.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(s)}
	}
	attrs := map[string]sqstypes.MessageAttributeValue{
		AttrErrorClass:  str(class),
		AttrErrorReason: str(reason),
		AttrConsumer:    str(h.cfg.Consumer),
		AttrSourceQueue: str(orDash(r.EventSourceARN)),
	}
	// Keep the published attributes (filters, trace context) within SQS's
	// limit of 10 per message.
	names := make([]string, 0, len(r.MessageAttributes))
	for k := range r.MessageAttributes {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		v := r.MessageAttributes[k]
		if len(attrs) == 10 || v.StringValue == nil || strings.HasPrefix(k, "fifobox_") {
			continue
		}
		attrs[k] = sqstypes.MessageAttributeValue{DataType: aws.String(v.DataType), StringValue: v.StringValue}
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
		MessageAttributes:      attrs,
	})
	return err
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
