package stacks

import (
	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/constructs-go/constructs/v10"
	"github.com/aws/jsii-runtime-go"
)

// LocalStack is the pipeline for an AWS emulator (LocalStack, Floci) deployed
// with cdklocal: the same topic, queues, functions, schedule, migration
// trigger and alarms, but no VPC, Aurora or RDS Proxy. The functions connect
// to cfg.DatabaseURL (context databaseUrl) as FIFOBOX_DATABASE_URL; from a
// Lambda container the host's PostgreSQL is usually host.docker.internal.
type LocalStack struct {
	awscdk.Stack
	*Pipeline
}

// NewLocalStack builds the local variant.
func NewLocalStack(scope constructs.Construct, id string, props *awscdk.StackProps, cfg Config) *LocalStack {
	stack := awscdk.NewStack(scope, jsii.String(id), props)
	return &LocalStack{Stack: stack, Pipeline: newPipeline(stack, cfg, nil)}
}
