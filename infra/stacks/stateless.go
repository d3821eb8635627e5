package stacks

import (
	"path/filepath"
	"strconv"

	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatch"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsec2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsiam"
	"github.com/aws/aws-cdk-go/awscdk/v2/awskms"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslambda"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslambdaeventsources"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslogs"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsrds"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsscheduler"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsschedulertargets"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssns"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssnssubscriptions"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssqs"
	"github.com/aws/aws-cdk-go/awscdk/v2/triggers"
	"github.com/aws/constructs-go/constructs/v10"
	"github.com/aws/jsii-runtime-go"
	"github.com/cdklabs/cdk-nag-go/cdknag/v2"

	"github.com/fifobox/fifobox/pkg/topology"
)

// Network is where the functions run and how they reach the database. The
// local variant has none: its functions get FIFOBOX_DATABASE_URL instead.
type Network struct {
	Vpc           awsec2.IVpc
	Subnets       *awsec2.SubnetSelection
	SecurityGroup awsec2.ISecurityGroup
	Proxy         awsrds.IDatabaseProxy
	// Cluster is the database fifobox created (nil with an existing proxy):
	// its functions then log in as their own users (FunctionDBUsers) and the
	// migration function as the master user, straight to the cluster.
	Cluster awsrds.DatabaseCluster
	// Broker is the RabbitMQ broker (transport rabbitmq).
	Broker *AMQPBroker
}

// ConsumerResources are one topology consumer's queue, DLQs and function.
type ConsumerResources struct {
	Consumer topology.Consumer
	Queue    awssqs.Queue
	// DLQ takes what the consumer could not process (poison, permanent
	// errors, maxReceiveCount).
	DLQ awssqs.Queue
	// SubscriptionDLQ takes what SNS could not deliver to Queue (a disabled
	// key, a changed queue policy, a deleted queue): without it SNS drops
	// those messages after its retries while the outbox already counts them
	// as sent.
	SubscriptionDLQ awssqs.Queue
	Function        awslambda.Function
}

// BrokerConsumer is one RabbitMQ consumer: its function on the broker's
// event source, reading Queue (the topology's names: the broker holds the
// queues, provisioned by the deploy trigger's migrate).
type BrokerConsumer struct {
	Name, Queue, DLQ string
	Function         awslambda.Function
	EventSource      awslambda.CfnEventSourceMapping
}

// Pipeline is the messaging layer and its functions, alarms and dashboard.
type Pipeline struct {
	TopicKey awskms.Key
	QueueKey awskms.Key
	// LogsKey encrypts the functions' log groups.
	LogsKey awskms.Key
	// Topic and Consumers: the SNS transport only.
	Topic     awssns.Topic
	Consumers []*ConsumerResources
	// BrokerConsumers and BrokerName (its metrics' Broker dimension): the
	// RabbitMQ transport only.
	BrokerConsumers []*BrokerConsumer
	BrokerName      *string
	Dispatcher      awslambda.Function
	Redrive         awslambda.Function
	ScheduleDLQ     awssqs.Queue
	Schedule        awsscheduler.Schedule
	// RetentionSchedule invokes the redrive function's prune daily.
	RetentionSchedule awsscheduler.Schedule
	Migrate           triggers.Trigger
	AlarmTopic        awssns.Topic
	Alarms            []awscloudwatch.Alarm
	Dashboard         awscloudwatch.Dashboard
}

// StatelessStack is the pipeline in AWS: functions in the VPC of the
// StatefulStack, reaching the database through RDS Proxy with IAM auth.
type StatelessStack struct {
	awscdk.Stack
	*Pipeline
}

// NewStatelessStack builds the pipeline on the given network.
func NewStatelessStack(scope constructs.Construct, id string, props *awscdk.StackProps, cfg Config, net *Network) *StatelessStack {
	stack := awscdk.NewStack(scope, jsii.String(id), props)
	return &StatelessStack{Stack: stack, Pipeline: newPipeline(stack, cfg, net)}
}

// newPipeline creates topic, queues, functions, schedule, migration trigger,
// alarms and dashboard in stack. net == nil is the local variant.
func newPipeline(stack awscdk.Stack, cfg Config, net *Network) *Pipeline {
	p := &Pipeline{}
	top := cfg.Topology

	// One customer-managed key for the topic, every queue and the alarm topic:
	// SNS and SQS need a CMK (not aws/sns, aws/sqs) to deliver to each other and
	// for CloudWatch alarms to publish.
	// Two keys, because the queue key's policy names the topic (SNS may use it
	// only on behalf of this topic) and the topic is encrypted: one key for
	// both would be a circular dependency.
	p.TopicKey = awskms.NewKey(stack, jsii.String("TopicKey"), &awskms.KeyProps{
		Description:       jsii.String("fifobox: SNS topics (events, alarms)"),
		EnableKeyRotation: jsii.Bool(true),
		Alias:             jsii.String("alias/" + cfg.Prefix + "-topics"),
	})
	p.QueueKey = awskms.NewKey(stack, jsii.String("QueueKey"), &awskms.KeyProps{
		Description:       jsii.String("fifobox: SQS queues and dead-letter queues"),
		EnableKeyRotation: jsii.Bool(true),
		Alias:             jsii.String("alias/" + cfg.Prefix + "-queues"),
	})

	p.LogsKey = newLogsKey(stack, "alias/"+cfg.Prefix+"-logs", "fifobox: the functions' log groups")
	denyGrantsToNonServices(p.TopicKey)
	denyGrantsToNonServices(p.QueueKey)

	// Each function's environment is what its loaders declare
	// (pkg/lambdafn/*.Env, pkg/db.Env, pkg/metrics.Env): the runtime contract
	// tests (functions/runtimetest) fail on a variable set here that nothing
	// reads, or a required one missing.
	metricsNamespace := jsii.String(cfg.Namespace())
	// common is fn's database environment (as the user fn logs in as) and
	// extra; grantDB lets a role log in as that user.
	common := func(fn string, extra map[string]*string) *map[string]*string {
		dbEnv, _ := databaseAccess(cfg, net, fn)
		env := map[string]*string{}
		for k, v := range dbEnv {
			env[k] = v
		}
		for k, v := range extra {
			env[k] = v
		}
		return &env
	}
	keyUse := func(role awsiam.Role, key awskms.Key) {
		// Explicit actions: the grant helpers add kms:ReEncrypt* / GenerateDataKey*.
		role.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
			Actions:   jsii.Strings("kms:GenerateDataKey", "kms:Decrypt"),
			Resources: jsii.Strings(*key.KeyArn()),
		}))
	}

	sns := cfg.Transport == TransportSNS
	if sns {
		scope := awssns.FifoThroughputScope_TOPIC
		if top.Topic.ThroughputScope == "MessageGroup" {
			scope = awssns.FifoThroughputScope_MESSAGE_GROUP
		}
		p.Topic = awssns.NewTopic(stack, jsii.String("Topic"), &awssns.TopicProps{
			TopicName: jsii.String(cfg.ResourceName(top.Topic.Name)),
			Fifo:      jsii.Bool(true),
			// The dispatcher sets MessageDeduplicationId = event id: dedup by content
			// would drop two distinct events with equal bodies.
			ContentBasedDeduplication: jsii.Bool(false),
			FifoThroughputScope:       scope,
			MasterKey:                 p.TopicKey,
			EnforceSSL:                jsii.Bool(true),
		})

		// Consumers: FIFO queue + FIFO DLQ + subscription + function.
		highThroughput := top.Topic.ThroughputScope == "MessageGroup"
		for _, c := range top.Consumers {
			cr := &ConsumerResources{Consumer: c}
			cr.DLQ = awssqs.NewQueue(stack, jsii.String("DLQ-"+c.Name), &awssqs.QueueProps{
				QueueName:           jsii.String(cfg.ResourceName(c.DLQName())),
				Fifo:                jsii.Bool(true),
				Encryption:          awssqs.QueueEncryption_KMS,
				EncryptionMasterKey: p.QueueKey,
				EnforceSSL:          jsii.Bool(true),
				RetentionPeriod:     awscdk.Duration_Days(jsii.Number(DLQRetentionDays)),
			})
			qp := &awssqs.QueueProps{
				QueueName:                 jsii.String(cfg.ResourceName(c.QueueName())),
				Fifo:                      jsii.Bool(true),
				ContentBasedDeduplication: jsii.Bool(false),
				VisibilityTimeout:         awscdk.Duration_Seconds(jsii.Number(float64(c.VisibilityTimeoutSeconds))),
				DeadLetterQueue:           &awssqs.DeadLetterQueue{Queue: cr.DLQ, MaxReceiveCount: jsii.Number(float64(c.ReceiveLimit()))},
				Encryption:                awssqs.QueueEncryption_KMS,
				EncryptionMasterKey:       p.QueueKey,
				EnforceSSL:                jsii.Bool(true),
				RetentionPeriod:           awscdk.Duration_Days(jsii.Number(4)),
			}
			if highThroughput {
				qp.DeduplicationScope = awssqs.DeduplicationScope_MESSAGE_GROUP
				qp.FifoThroughputLimit = awssqs.FifoThroughputLimit_PER_MESSAGE_GROUP_ID
			}
			cr.Queue = awssqs.NewQueue(stack, jsii.String("Queue-"+c.Name), qp)

			// SNS requires a FIFO topic's subscription DLQ to be a FIFO queue in
			// the same account and region. The subscription adds the queue policy
			// letting this topic's SNS send to it (aws:SourceArn = the topic); the
			// queue key already lets SNS use it on behalf of this topic (the
			// restrictSqsDescryption flag's statement), as for the consumer queue.
			cr.SubscriptionDLQ = awssqs.NewQueue(stack, jsii.String("SubscriptionDLQ-"+c.Name), &awssqs.QueueProps{
				QueueName:                 jsii.String(cfg.ResourceName(c.SubscriptionDLQName())),
				Fifo:                      jsii.Bool(true),
				ContentBasedDeduplication: jsii.Bool(false),
				Encryption:                awssqs.QueueEncryption_KMS,
				EncryptionMasterKey:       p.QueueKey,
				EnforceSSL:                jsii.Bool(true),
				RetentionPeriod:           awscdk.Duration_Days(jsii.Number(DLQRetentionDays)),
			})
			cdknag.NagSuppressions_AddResourceSuppressions(cr.SubscriptionDLQ, &[]*cdknag.NagPackSuppression{{
				Id:     jsii.String("AwsSolutions-SQS3"),
				Reason: jsii.String("This queue is the dead-letter queue of the consumer's SNS subscription (its RedrivePolicy), which cdk-nag does not recognise as a DLQ; it is alarmed on."),
			}}, nil)
			suppressGuard(cr.SubscriptionDLQ, "sqs_dlq_check", "This queue is the dead-letter queue of an SNS subscription; a dead-letter queue of a dead-letter queue would only move its messages again. It is alarmed on and drained with `fifobox redrive --from subscription-dlq`.")
			suppressGuard(cr.DLQ, "sqs_dlq_check", "This queue is the consumer queue's dead-letter queue; a dead-letter queue of a dead-letter queue would only move its messages again. It is alarmed on and drained with `fifobox redrive`.")

			// Filter on message attributes (the default scope), exactly the policy
			// topology.Consumer.FilterPolicy() describes.
			var filter *map[string]awssns.SubscriptionFilter
			if len(c.Filter) > 0 {
				m := map[string]awssns.SubscriptionFilter{}
				for attr, values := range c.Filter {
					m[attr] = awssns.SubscriptionFilter_StringFilter(&awssns.StringConditions{Allowlist: jsii.Strings(values...)})
				}
				filter = &m
			}
			p.Topic.AddSubscription(awssnssubscriptions.NewSqsSubscription(cr.Queue, &awssnssubscriptions.SqsSubscriptionProps{
				RawMessageDelivery: jsii.Bool(true),
				FilterPolicy:       filter,
				DeadLetterQueue:    cr.SubscriptionDLQ,
			}))

			fn, role := newFunction(stack, cfg, net, "Consumer-"+c.Name, FnConsumer, functionOptions{
				description: "fifobox consumer " + c.Name,
				logsKey:     p.LogsKey,
				timeout:     float64(c.FunctionTimeoutSeconds),
				memoryMB:    cfg.ConsumerMemoryMB,
				env: common(FnConsumer, map[string]*string{
					"FIFOBOX_CONSUMER_NAME":     jsii.String(c.Name),
					"FIFOBOX_DLQ_URL":           cr.DLQ.QueueUrl(),
					"FIFOBOX_METRICS_NAMESPACE": metricsNamespace,
					// The handler's retry budget and the redrive policy's
					// backstop above, from the same topology entry.
					"FIFOBOX_MAX_RETRIES":       jsii.String(strconv.Itoa(c.Retries())),
					"FIFOBOX_MAX_RECEIVE_COUNT": jsii.String(strconv.Itoa(c.ReceiveLimit())),
				}),
			})
			grantDB(cfg, net, FnConsumer, role)
			keyUse(role, p.QueueKey)
			// Poison and permanently failing records go to the DLQ directly.
			role.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
				Actions: jsii.Strings("sqs:SendMessage"), Resources: jsii.Strings(*cr.DLQ.QueueArn()),
			}))
			// FIFO: batch size at most 10 and no batching window. The function
			// returns the failed record and every later one (ReportBatchItemFailures).
			// The mapping grants receive/delete/change-visibility on the queue.
			fn.AddEventSource(awslambdaeventsources.NewSqsEventSource(cr.Queue, &awslambdaeventsources.SqsEventSourceProps{
				BatchSize:               jsii.Number(10),
				ReportBatchItemFailures: jsii.Bool(true),
				MaxConcurrency:          jsii.Number(float64(c.MaxConcurrency)),
			}))
			cr.Function = fn
			p.Consumers = append(p.Consumers, cr)
		}

	}
	broker := newBrokerAccess(stack, cfg, net)
	if cfg.Transport == TransportRabbitMQ {
		p.BrokerName = net.Broker.Name
		newBrokerConsumers(stack, cfg, net, p, common, broker)
	}

	// Dispatcher: polls the outbox inside each invocation until shortly before
	// its deadline, so a once-a-minute schedule still publishes continuously.
	dispatcherEnv := map[string]*string{"FIFOBOX_METRICS_NAMESPACE": metricsNamespace}
	if sns {
		dispatcherEnv["FIFOBOX_TOPIC_ARN"] = p.Topic.TopicArn()
	}
	for k, v := range broker.env(stack, BrokerUserDispatcher) {
		dispatcherEnv[k] = v
	}
	dispatcher, drole := newFunction(stack, cfg, net, "Dispatcher", FnDispatcher, functionOptions{
		description: "fifobox dispatcher: outbox -> " + transportName(cfg),
		logsKey:     p.LogsKey,
		timeout:     cfg.DispatcherTimeoutSeconds,
		memoryMB:    cfg.DispatcherMemoryMB,
		reserved:    cfg.DispatcherReservedConcurrency,
		// The schedule invokes asynchronously; the next tick is the retry, so
		// Lambda's own async retries would only stack invocations up.
		asyncRetries: true,
		env:          common(FnDispatcher, dispatcherEnv),
	})
	grantDB(cfg, net, FnDispatcher, drole)
	if sns {
		keyUse(drole, p.TopicKey)
		drole.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
			Actions: jsii.Strings("sns:Publish"), Resources: jsii.Strings(*p.Topic.TopicArn()),
		}))
	} else {
		broker.grant(BrokerUserDispatcher, drole)
	}
	p.Dispatcher = dispatcher

	// Redrive / operations function. Where fifobox created the database, a
	// separate migration function (the same code, as the master user) runs
	// the migrations; otherwise the operations function's default operation
	// is migrate, which the deploy trigger below relies on (a Trigger cannot
	// choose a payload).
	queues := map[string]any{}
	for _, cr := range p.Consumers {
		queues[cr.Consumer.Name] = map[string]any{
			"queue_url": cr.Queue.QueueUrl(), "dlq_url": cr.DLQ.QueueUrl(),
			"subscription_dlq_url": cr.SubscriptionDLQ.QueueUrl(),
		}
	}
	// A separate migration function where fifobox created the database
	// (the master user's), and with RabbitMQ (the broker administrator's
	// secret is the provisioner's alone).
	separateMigrator := ownUsers(net) || (net != nil && cfg.Transport == TransportRabbitMQ)
	opsDefault := "migrate"
	if separateMigrator {
		opsDefault = "status"
	}
	redriveEnv := map[string]*string{"FIFOBOX_DEFAULT_OPERATION": jsii.String(opsDefault)}
	if sns {
		redriveEnv["FIFOBOX_QUEUES"] = stack.ToJsonString(queues, nil)
	}
	for k, v := range broker.env(stack, BrokerUserOperations) {
		redriveEnv[k] = v
	}
	redrive, rrole := newFunction(stack, cfg, net, "Redrive", FnRedrive, functionOptions{
		description: "fifobox operations: migrate, status, dead-list, requeue-dead, replay, dlq-redrive, prune",
		logsKey:     p.LogsKey,
		timeout:     cfg.RedriveTimeoutSeconds,
		memoryMB:    256,
		env:         common(FnRedrive, redriveEnv),
	})
	grantDB(cfg, net, FnRedrive, rrole)
	broker.grant(BrokerUserOperations, rrole)
	if sns {
		keyUse(rrole, p.QueueKey)
	}
	// Redrive moves messages from both DLQs of a consumer (the consumer's
	// and its subscription's) back to the consumer's queue.
	var queueArns, dlqArns []*string
	for _, cr := range p.Consumers {
		queueArns = append(queueArns, cr.Queue.QueueArn())
		dlqArns = append(dlqArns, cr.DLQ.QueueArn(), cr.SubscriptionDLQ.QueueArn())
	}
	if sns {
		rrole.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
			Sid:       jsii.String("ReplayAndRedriveIntoQueues"),
			Actions:   jsii.Strings("sqs:SendMessage", "sqs:GetQueueAttributes"),
			Resources: &queueArns,
		}))
		rrole.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
			Sid:       jsii.String("DrainDeadLetterQueues"),
			Actions:   jsii.Strings("sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility", "sqs:GetQueueAttributes"),
			Resources: &dlqArns,
		}))
	}
	p.Redrive = redrive

	// Apply migrations on every deploy that changes the redrive function, and
	// before the schedule and the consumers start.
	before := []constructs.Construct{}
	for _, cr := range p.Consumers {
		before = append(before, cr.Function)
	}
	migrator := redrive
	if separateMigrator {
		migrator = newMigrationFunction(stack, cfg, net, p, broker)
	}
	p.Migrate = triggers.NewTrigger(stack, jsii.String("Migrate"), &triggers.TriggerProps{
		Handler:                migrator,
		InvocationType:         triggers.InvocationType_REQUEST_RESPONSE,
		Timeout:                awscdk.Duration_Seconds(jsii.Number(cfg.RedriveTimeoutSeconds)),
		ExecuteOnHandlerChange: jsii.Bool(true),
		ExecuteBefore:          &before,
	})
	suppressGuardAt(stack, []string{"AWSCDK.TriggerCustomResourceProviderCustomResourceProvider", "Handler"}, "lambda_inside_vpc_check",
		"CDK's trigger provider (invokes the redrive function's migrate on deploy). "+providerOutsideVpc)

	// EventBridge Scheduler: once a minute (its finest rate). Its DLQ must be a
	// standard queue; undeliverable invocations land there and alarm.
	p.ScheduleDLQ = awssqs.NewQueue(stack, jsii.String("ScheduleDLQ"), &awssqs.QueueProps{
		Encryption:          awssqs.QueueEncryption_KMS,
		EncryptionMasterKey: p.QueueKey,
		EnforceSSL:          jsii.Bool(true),
		RetentionPeriod:     awscdk.Duration_Days(jsii.Number(14)),
	})
	schedRole := awsiam.NewRole(stack, jsii.String("ScheduleRole"), &awsiam.RoleProps{
		AssumedBy: awsiam.NewServicePrincipal(jsii.String("scheduler.amazonaws.com"), &awsiam.ServicePrincipalOpts{
			Conditions: &map[string]any{"StringEquals": map[string]any{"aws:SourceAccount": stack.Account()}},
		}),
		Description: jsii.String("EventBridge Scheduler: invoke the fifobox dispatcher and the daily prune, dead-letter to the schedule DLQ"),
	})
	keyUse(schedRole, p.QueueKey)
	p.Schedule = awsscheduler.NewSchedule(stack, jsii.String("DispatcherSchedule"), &awsscheduler.ScheduleProps{
		Description: jsii.String("Runs the fifobox dispatcher every minute"),
		Schedule:    awsscheduler.ScheduleExpression_Rate(awscdk.Duration_Minutes(jsii.Number(1))),
		Target: awsschedulertargets.NewLambdaInvoke(dispatcher, &awsschedulertargets.ScheduleTargetBaseProps{
			Role:            schedRole,
			DeadLetterQueue: p.ScheduleDLQ,
			RetryAttempts:   jsii.Number(2),
			MaxEventAge:     awscdk.Duration_Minutes(jsii.Number(2)),
		}),
	})
	p.Schedule.Node().AddDependency(p.Migrate)
	// The broker's event sources start once migrate has declared their queues.
	for _, bc := range p.BrokerConsumers {
		bc.EventSource.Node().AddDependency(p.Migrate)
	}

	// Retention, daily at a quiet hour: the redrive function's prune deletes
	// sent events and inbox rows past their retention, in bounded batches,
	// stopping before its timeout (the next day continues). Audited like any
	// operator action. The input is redrive.Command's JSON, written out here
	// to keep this module free of the application's dependencies;
	// TestRetentionSchedulePayloadDecodes (pkg/lambdafn/redrive) checks it.
	p.RetentionSchedule = awsscheduler.NewSchedule(stack, jsii.String("RetentionSchedule"), &awsscheduler.ScheduleProps{
		Description: jsii.String("Prunes sent outbox events and old inbox rows daily"),
		Schedule:    awsscheduler.ScheduleExpression_Cron(&awsscheduler.CronOptionsWithTimezone{Hour: jsii.String("3"), Minute: jsii.String("17")}),
		Target: awsschedulertargets.NewLambdaInvoke(redrive, &awsschedulertargets.ScheduleTargetBaseProps{
			Role:            schedRole,
			DeadLetterQueue: p.ScheduleDLQ,
			RetryAttempts:   jsii.Number(2),
			Input: awsscheduler.ScheduleTargetInput_FromObject(map[string]any{
				"operation": "prune", "actor": "schedule:retention",
				"older_than": cfg.OutboxRetention, "inbox_older_than": cfg.InboxRetention,
			}),
		}),
	})
	p.RetentionSchedule.Node().AddDependency(p.Migrate)

	suppressGuard(p.ScheduleDLQ, "sqs_dlq_check", "This queue is the EventBridge Scheduler dead-letter queue (it must be a standard queue); a dead-letter queue of a dead-letter queue would only move its messages again. It is alarmed on.")
	cdknag.NagSuppressions_AddResourceSuppressions(p.ScheduleDLQ, &[]*cdknag.NagPackSuppression{{
		Id:     jsii.String("AwsSolutions-SQS3"),
		Reason: jsii.String("This queue is the EventBridge Scheduler dead-letter queue of the dispatcher and retention schedules (a schedule target DLQ, which cdk-nag does not recognise); it is alarmed on."),
	}}, nil)
	cdknag.NagSuppressions_AddResourceSuppressions(schedRole, &[]*cdknag.NagPackSuppression{{
		Id:        jsii.String("AwsSolutions-IAM5"),
		Reason:    jsii.String("CDK's LambdaInvoke targets grant lambda:InvokeFunction on the dispatcher and the redrive function (daily prune) and their versions (<arn>:*); the role can invoke nothing else."),
		AppliesTo: &[]any{cdknag.RegexAppliesTo{Regex: jsii.String(`/^Resource::<(Dispatcher|Redrive)[A-Za-z0-9]+\.Arn>:\*$/g`)}},
	}}, jsii.Bool(true))

	newAlarms(stack, cfg, p, net)
	newDashboard(stack, cfg, p)
	return p
}

// ownUsers says whether the functions log in as their own database users:
// where fifobox created the database (and so its proxy, with end-to-end
// IAM). With an existing proxy they log in as Config.DatabaseUser, whom that
// proxy knows; see docs/deploying.md for mapping roles there.
func ownUsers(net *Network) bool { return net != nil && net.Cluster != nil }

// dbUser is the database user function fn logs in as.
func dbUser(cfg Config, net *Network, fn string) string {
	if ownUsers(net) {
		return FunctionDBUsers[fn]
	}
	return cfg.DatabaseUser
}

// databaseAccess returns function fn's database environment and a function
// granting a role access: rds-db:connect as fn's database user on the
// proxy, or nothing for a plain URL (local variant).
func databaseAccess(cfg Config, net *Network, fn string) (map[string]*string, func(awsiam.Role)) {
	if net == nil {
		return map[string]*string{"FIFOBOX_DATABASE_URL": jsii.String(cfg.DatabaseURL)}, func(awsiam.Role) {}
	}
	user := dbUser(cfg, net, fn)
	env := map[string]*string{
		"FIFOBOX_DB_HOST":     net.Proxy.Endpoint(),
		"FIFOBOX_DB_PORT":     jsii.String(strconv.Itoa(DBPort)),
		"FIFOBOX_DB_NAME":     jsii.String(cfg.DatabaseName),
		"FIFOBOX_DB_USER":     jsii.String(user),
		"FIFOBOX_DB_IAM_AUTH": jsii.String("true"),
	}
	return env, func(role awsiam.Role) { net.Proxy.GrantConnect(role, jsii.String(user)) }
}

// grantDB lets role log in as function fn's database user.
func grantDB(cfg Config, net *Network, fn string, role awsiam.Role) {
	_, grant := databaseAccess(cfg, net, fn)
	grant(role)
}

// newMigrationFunction is the deploy trigger's function: the operations
// code with migrate as its default operation, logging in as the master user
// (the owner of fifobox's tables) with the cluster's secret, straight to the
// cluster's writer. Nothing else may invoke it.
func newMigrationFunction(stack awscdk.Stack, cfg Config, net *Network, p *Pipeline, broker *brokerAccess) awslambda.Function {
	env := map[string]*string{"FIFOBOX_DEFAULT_OPERATION": jsii.String("migrate")}
	if ownUsers(net) {
		env["FIFOBOX_DB_HOST"] = net.Cluster.ClusterEndpoint().Hostname()
		env["FIFOBOX_DB_PORT"] = jsii.String(strconv.Itoa(DBPort))
		env["FIFOBOX_DB_NAME"] = jsii.String(cfg.DatabaseName)
		env["FIFOBOX_DB_SECRET_ARN"] = net.Cluster.Secret().SecretArn()
	} else {
		// An existing proxy: the operations function's database user.
		dbEnv, _ := databaseAccess(cfg, net, FnRedrive)
		for k, v := range dbEnv {
			env[k] = v
		}
	}
	// With a broker, migrate also declares its topology and, on RabbitMQ,
	// creates the functions' users as the administrator (pkg/redrive).
	for k, v := range broker.env(stack, BrokerUserProvisioner) {
		env[k] = v
	}
	fn, role := newFunction(stack, cfg, net, "Migration", FnRedrive, functionOptions{
		description: "fifobox migrations (deploy trigger), as the database owner",
		logsKey:     p.LogsKey,
		timeout:     cfg.RedriveTimeoutSeconds,
		memoryMB:    256,
		env:         &env,
	})
	if ownUsers(net) {
		net.Cluster.Secret().GrantRead(role, nil)
	} else {
		grantDB(cfg, net, FnRedrive, role)
	}
	broker.grant(BrokerUserProvisioner, role)
	return fn
}

type functionOptions struct {
	description  string
	logsKey      awskms.IKey
	timeout      float64
	memoryMB     float64
	reserved     float64
	asyncRetries bool
	env          *map[string]*string
}

// newFunction creates a provided.al2023 arm64 function from
// <AssetDir>/<dir>/bootstrap with its own role and log group. The role gets
// only: writing to its log group, and (in a VPC) managing its network
// interfaces; callers add what the function itself calls.
func newFunction(stack awscdk.Stack, cfg Config, net *Network, id, dir string, o functionOptions) (awslambda.Function, awsiam.Role) {
	// A year of logs (Control Tower's CT.CLOUDWATCH.PR.2), encrypted with the
	// stack's logs key (CT.CLOUDWATCH.PR.3): the logs name events and
	// consumers, never payloads, but an operator's audit trail lives there.
	logs := awslogs.NewLogGroup(stack, jsii.String(id+"Logs"), &awslogs.LogGroupProps{
		Retention:     LogRetention,
		EncryptionKey: o.logsKey,
		RemovalPolicy: awscdk.RemovalPolicy_DESTROY,
	})
	role := awsiam.NewRole(stack, jsii.String(id+"Role"), &awsiam.RoleProps{
		AssumedBy:   awsiam.NewServicePrincipal(jsii.String("lambda.amazonaws.com"), nil),
		Description: jsii.String("Execution role of " + o.description),
	})
	// Instead of AWSLambdaBasicExecutionRole (logs:* on every log group).
	role.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
		Sid:       jsii.String("WriteOwnLogGroup"),
		Actions:   jsii.Strings("logs:CreateLogStream", "logs:PutLogEvents"),
		Resources: jsii.Strings(*logs.LogGroupArn()),
	}))
	props := &awslambda.FunctionProps{
		Description:  jsii.String(o.description),
		Runtime:      awslambda.Runtime_PROVIDED_AL2023(),
		Architecture: awslambda.Architecture_ARM_64(),
		Handler:      jsii.String("bootstrap"),
		Code:         awslambda.Code_FromAsset(jsii.String(filepath.Join(cfg.AssetDir, dir)), nil),
		Timeout:      awscdk.Duration_Seconds(jsii.Number(o.timeout)),
		MemorySize:   jsii.Number(o.memoryMB),
		Environment:  o.env,
		Role:         role,
		LogGroup:     logs,
	}
	if o.reserved > 0 {
		props.ReservedConcurrentExecutions = jsii.Number(o.reserved)
	}
	if o.asyncRetries {
		props.RetryAttempts = jsii.Number(0)
		props.MaxEventAge = awscdk.Duration_Minutes(jsii.Number(2))
	}
	if net != nil {
		props.Vpc = net.Vpc
		props.VpcSubnets = net.Subnets
		props.SecurityGroups = &[]awsec2.ISecurityGroup{net.SecurityGroup}
		// Instead of AWSLambdaVPCAccessExecutionRole: the same ENI actions,
		// which have no resource-level scoping for Describe*.
		role.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
			Sid: jsii.String("ManageVpcNetworkInterfaces"),
			Actions: jsii.Strings("ec2:CreateNetworkInterface", "ec2:DescribeNetworkInterfaces", "ec2:DescribeSubnets",
				"ec2:DeleteNetworkInterface", "ec2:AssignPrivateIpAddresses", "ec2:UnassignPrivateIpAddresses"),
			Resources: jsii.Strings("*"),
		}))
		cdknag.NagSuppressions_AddResourceSuppressions(role, &[]*cdknag.NagPackSuppression{{
			Id:        jsii.String("AwsSolutions-IAM5"),
			Reason:    jsii.String("Lambda needs these EC2 network-interface actions to attach the function to the VPC; they are the actions of AWSLambdaVPCAccessExecutionRole and do not support resource-level permissions (Describe*) or act on ENIs Lambda creates."),
			AppliesTo: &[]any{jsii.String("Resource::*")},
		}}, jsii.Bool(true))
	}
	fn := awslambda.NewFunction(stack, jsii.String(id), props)
	if net != nil {
		suppressGuard(fn, "lambda_inside_vpc_check", "The function is in the VPC (VpcConfig with the stateful stack's isolated subnets and the functions' security group; TestFunctions checks it), but its subnet and security group ids are cross-stack references (Fn::GetStackOutput) the rule cannot resolve.")
	} else {
		suppressGuard(fn, "lambda_inside_vpc_check", "The local variant (LocalStack/Floci, cdklocal) has no VPC by design: it runs the functions in the emulator's containers against a local database. The AWS stacks put every function in the VPC.")
	}
	// Names the bootstrap the function runs, for the tests that check each
	// function's environment against what that binary reads.
	awscdk.Tags_Of(fn).Add(jsii.String(FunctionTag), jsii.String(dir), nil)
	return fn, role
}
