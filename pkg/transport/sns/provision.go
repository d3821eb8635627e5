package sns

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	snssvc "github.com/aws/aws-sdk-go-v2/service/sns"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/fifobox/fifobox/pkg/topology"
)

// ProvisionOptions adjust names and timings for local use.
type ProvisionOptions struct {
	// Prefix is prepended to every topic and queue name, so parallel tests
	// get their own resources on one emulator. Default none.
	Prefix string
	// VisibilityTimeoutSeconds overrides every queue's visibility timeout
	// (tests use a few seconds instead of minutes). Default: the topology's.
	VisibilityTimeoutSeconds int
}

// Queue is one consumer's provisioned queues.
type Queue struct {
	Name   string
	URL    string
	ARN    string
	DLQURL string
	DLQARN string
	// SubDLQURL and SubDLQARN are the subscription's dead-letter queue:
	// messages SNS could not deliver to the queue. (fauxqs 2.4.1 stores the
	// subscription's RedrivePolicy but never uses it: a failed delivery is
	// dropped there. AWS, LocalStack and Floci deliver to it.)
	SubDLQURL string
	SubDLQARN string
	Consumer  topology.Consumer
}

// Resources are what Provision created (or found).
type Resources struct {
	TopicARN string
	// Queues by consumer name.
	Queues map[string]Queue
}

// Provision creates a topology (SNS FIFO topic, SQS FIFO queues and DLQs,
// raw-delivery subscriptions with filter policies and their own FIFO
// dead-letter queues) through the AWS API. It is what make local and the
// integration tests use against the local emulator, LocalStack or Floci; in
// AWS the CDK app creates the same resources from the same topology
// definition. It is idempotent: creating an existing topic, queue or
// subscription with the same attributes returns it.
func Provision(ctx context.Context, snsc SNSAPI, sqsc SQSAPI, t topology.Topology, opt ProvisionOptions) (Resources, error) {
	if err := t.Validate(); err != nil {
		return Resources{}, fmt.Errorf("provision: %w", err)
	}
	topic, err := snsc.CreateTopic(ctx, &snssvc.CreateTopicInput{
		Name: aws.String(opt.Prefix + t.Topic.Name),
		Attributes: map[string]string{
			"FifoTopic":                 "true",
			"ContentBasedDeduplication": "false",
			"FifoThroughputScope":       t.Topic.ThroughputScope,
		},
	})
	if err != nil {
		return Resources{}, fmt.Errorf("provision: create topic %s: %w", t.Topic.Name, err)
	}
	res := Resources{TopicARN: aws.ToString(topic.TopicArn), Queues: map[string]Queue{}}
	for _, c := range t.Consumers {
		q, err := provisionConsumer(ctx, snsc, sqsc, res.TopicARN, c, opt)
		if err != nil {
			return Resources{}, fmt.Errorf("provision consumer %s: %w", c.Name, err)
		}
		res.Queues[c.Name] = q
	}
	return res, nil
}

func provisionConsumer(ctx context.Context, snsc SNSAPI, sqsc SQSAPI, topicARN string, c topology.Consumer, opt ProvisionOptions) (Queue, error) {
	vis := c.VisibilityTimeoutSeconds
	if opt.VisibilityTimeoutSeconds > 0 {
		vis = opt.VisibilityTimeoutSeconds
	}
	dlqURL, dlqARN, err := createQueue(ctx, sqsc, opt.Prefix+c.DLQName(), map[string]string{
		"FifoQueue":              "true",
		"MessageRetentionPeriod": strconv.Itoa(int(topology.DLQRetention / time.Second)),
	})
	if err != nil {
		return Queue{}, err
	}
	subDLQURL, subDLQARN, err := createQueue(ctx, sqsc, opt.Prefix+c.SubscriptionDLQName(), map[string]string{
		"FifoQueue":              "true",
		"MessageRetentionPeriod": strconv.Itoa(int(topology.DLQRetention / time.Second)),
	})
	if err != nil {
		return Queue{}, err
	}
	redrive, _ := json.Marshal(map[string]string{"deadLetterTargetArn": dlqARN, "maxReceiveCount": strconv.Itoa(c.ReceiveLimit())})
	url, arn, err := createQueue(ctx, sqsc, opt.Prefix+c.QueueName(), map[string]string{
		"FifoQueue":         "true",
		"VisibilityTimeout": strconv.Itoa(vis),
		"RedrivePolicy":     string(redrive),
	})
	if err != nil {
		return Queue{}, err
	}
	subRedrive, _ := json.Marshal(map[string]string{"deadLetterTargetArn": subDLQARN})
	attrs := map[string]string{"RawMessageDelivery": strconv.FormatBool(c.RawDelivery()), "RedrivePolicy": string(subRedrive)}
	if fp := c.FilterPolicy(); fp != "" {
		attrs["FilterPolicy"] = fp
		attrs["FilterPolicyScope"] = "MessageAttributes"
	}
	if _, err := snsc.Subscribe(ctx, &snssvc.SubscribeInput{
		TopicArn: aws.String(topicARN), Protocol: aws.String("sqs"), Endpoint: aws.String(arn),
		Attributes: attrs, ReturnSubscriptionArn: true,
	}); err != nil {
		return Queue{}, fmt.Errorf("subscribe %s: %w", c.QueueName(), err)
	}
	return Queue{Name: opt.Prefix + c.QueueName(), URL: url, ARN: arn, DLQURL: dlqURL, DLQARN: dlqARN,
		SubDLQURL: subDLQURL, SubDLQARN: subDLQARN, Consumer: c}, nil
}

func createQueue(ctx context.Context, sqsc SQSAPI, name string, attrs map[string]string) (url, arn string, err error) {
	out, err := sqsc.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(name), Attributes: attrs})
	if err != nil {
		return "", "", fmt.Errorf("create queue %s: %w", name, err)
	}
	url = aws.ToString(out.QueueUrl)
	ga, err := sqsc.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{
		QueueUrl: aws.String(url), AttributeNames: []sqstypes.QueueAttributeName{sqstypes.QueueAttributeNameQueueArn},
	})
	if err != nil {
		return "", "", fmt.Errorf("queue %s arn: %w", name, err)
	}
	return url, ga.Attributes["QueueArn"], nil
}
